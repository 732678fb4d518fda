"""The UNet's conditioning for one batch: text-encoder outputs (cached or live) and SDXL's size ids."""

from __future__ import annotations

from typing import Any


class Conditioner:
    """UNet conditioning for a batch: cached text-encoder outputs when the batch carries them, else a
    live encode (with gradients only when the text-encoder LoRA trains); SDXL adds size conditioning."""

    def __init__(self, bundle: Any, *, max_token_length: int | None, clip_skip: int | None, dtype: Any) -> None:
        self.bundle, self.max_token_length, self.clip_skip, self.dtype = bundle, max_token_length, clip_skip, dtype

    def condition(self, batch: dict[str, Any], *, train: bool) -> tuple[Any, dict[str, Any] | None]:
        """``(encoder_hidden_states, added_cond_kwargs)``; the second is None for SD 1.x/2.x."""
        import torch

        from sd_scripts_compat.models.text_encoding import encode_prompts, sdxl_time_ids

        if "encoder_hidden_states" in batch:
            hidden, pooled = batch["encoder_hidden_states"].to(self.dtype), batch.get("pooled")
        else:
            with torch.set_grad_enabled(train):
                encoded = encode_prompts(self.bundle, batch["captions"], max_token_length=self.max_token_length,
                                         clip_skip=self.clip_skip, dtype=self.dtype)
            hidden, pooled = encoded.encoder_hidden_states, encoded.pooled
        if not self.bundle.family.is_sdxl:
            return hidden, None
        time_ids = sdxl_time_ids(batch["original_sizes_hw"], batch["crop_top_lefts"], batch["target_sizes_hw"],
                                 dtype=self.dtype).to(hidden.device)
        return hidden, {"text_embeds": pooled.to(hidden.device, self.dtype), "time_ids": time_ids}
