"""The denoiser's conditioning for one batch: text-encoder outputs (cached or live), then what the family's
runtime adds (SDXL's size ids, FLUX.1's and SD3's pooled vector and T5 mask)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sd_scripts_compat.runtimes import FamilyRuntime, TextOptions

if TYPE_CHECKING:
    from sd_scripts_compat.models.build import ModelBundle
    from sd_scripts_compat.models.text_encoding import TextConditioning


class Conditioner:
    """Denoiser conditioning for a batch: cached text-encoder outputs when the batch carries them, else a
    live encode (with gradients only when the text-encoder LoRA trains), both through the family's runtime."""

    def __init__(self, bundle: ModelBundle, runtime: FamilyRuntime, options: TextOptions) -> None:
        self.bundle, self.runtime, self.options = bundle, runtime, options
        self.dtype = options.dtype

    def encode(self, captions: list[str], *, train: bool = False) -> TextConditioning:
        """The runtime's ``encode_prompts`` with this run's options (a ``TextConditioning``)."""
        import torch

        with torch.set_grad_enabled(train):
            return self.runtime.encode_prompts(self.bundle, captions, self.options)

    def condition(self, batch: dict[str, Any], *, train: bool) -> tuple[Any, dict[str, Any] | None]:
        """``(encoder_hidden_states, added)``; ``added`` is None for SD 1.x/2.x, SDXL's
        ``added_cond_kwargs``, or FLUX's and SD3's ``{"pooled", "t5_attn_mask"}``."""
        if "encoder_hidden_states" in batch:
            hidden, pooled = batch["encoder_hidden_states"].to(self.dtype), batch.get("pooled")
            mask = batch.get("t5_attn_mask")
        else:
            encoded = self.encode(batch["captions"], train=train)
            hidden, pooled = encoded.encoder_hidden_states, encoded.pooled
            mask = getattr(encoded, "attention_mask", None)
        return self.runtime.conditioning(self.bundle, hidden, pooled, mask, batch, self.options)
