"""The denoiser's conditioning for one batch: text-encoder outputs (cached or live), SDXL's size ids,
FLUX.1's pooled CLIP vector and T5 attention mask."""

from __future__ import annotations

from typing import Any


class Conditioner:
    """Denoiser conditioning for a batch: cached text-encoder outputs when the batch carries them, else a
    live encode (with gradients only when the text-encoder LoRA trains). What is added besides the hidden
    states follows the family's data: SDXL's size conditioning (``is_sdxl``), FLUX.1's pooled CLIP-L
    output and T5 mask (a flow-matching family)."""

    def __init__(self, bundle: Any, *, max_token_length: int | None, clip_skip: int | None, dtype: Any,
                 t5_max_length: int | None = None, apply_t5_attn_mask: bool = False,
                 apply_lg_attn_mask: bool = False) -> None:
        self.bundle, self.max_token_length, self.clip_skip, self.dtype = bundle, max_token_length, clip_skip, dtype
        self.t5_max_length, self.apply_t5_attn_mask = t5_max_length, apply_t5_attn_mask
        self.apply_lg_attn_mask = apply_lg_attn_mask  # SD3: zero CLIP-L/G padding outputs
        self.flow_matching = getattr(bundle.family, "objective", "") == "flow_matching"

    def encode(self, captions: list[str], *, train: bool = False) -> Any:
        """``models.text_encoding.encode_prompts`` with this run's options (a ``TextConditioning``)."""
        import torch

        from sd_scripts_compat.models.text_encoding import encode_prompts

        extra = {"t5xxl_max_token_length": self.t5_max_length, "apply_t5_attn_mask": self.apply_t5_attn_mask,
                 "apply_lg_attn_mask": self.apply_lg_attn_mask} if self.flow_matching else {}
        with torch.set_grad_enabled(train):
            return encode_prompts(self.bundle, captions, max_token_length=self.max_token_length,
                                  clip_skip=self.clip_skip, dtype=self.dtype, **extra)

    def condition(self, batch: dict[str, Any], *, train: bool) -> tuple[Any, dict[str, Any] | None]:
        """``(encoder_hidden_states, added)``; ``added`` is None for SD 1.x/2.x, SDXL's
        ``added_cond_kwargs``, or FLUX's ``{"pooled", "t5_attn_mask"}``."""
        from sd_scripts_compat.models.text_encoding import sdxl_time_ids

        if "encoder_hidden_states" in batch:
            hidden, pooled = batch["encoder_hidden_states"].to(self.dtype), batch.get("pooled")
            mask = batch.get("t5_attn_mask")
        else:
            encoded = self.encode(batch["captions"], train=train)
            hidden, pooled = encoded.encoder_hidden_states, encoded.pooled
            mask = getattr(encoded, "attention_mask", None)
        if self.flow_matching:
            mask = mask.to(hidden.device) if mask is not None and self.apply_t5_attn_mask else None
            pooled = pooled.to(hidden.device, self.dtype) if pooled is not None else None  # Chroma: no CLIP-L
            return hidden, {"pooled": pooled, "t5_attn_mask": mask}
        if not self.bundle.family.is_sdxl:
            return hidden, None
        time_ids = sdxl_time_ids(batch["original_sizes_hw"], batch["crop_top_lefts"], batch["target_sizes_hw"],
                                 dtype=self.dtype).to(hidden.device)
        return hidden, {"text_embeds": pooled.to(hidden.device, self.dtype), "time_ids": time_ids}

    def flux_texts(self, captions: list[str]) -> tuple[Any, Any, Any]:
        """(T5 hidden states, pooled CLIP-L, T5 mask or None) for sampling."""
        encoded = self.encode(captions)
        mask = getattr(encoded, "attention_mask", None) if self.apply_t5_attn_mask else None
        return encoded.encoder_hidden_states, encoded.pooled, mask
