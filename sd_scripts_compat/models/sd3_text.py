"""SD3's text conditioning as sd-scripts' ``strategy_sd3`` builds it: CLIP-L and CLIP-G penultimate hidden states
(77 tokens each) side by side on the feature axis, zero-padded to T5-XXL's width and followed by T5-XXL's
``t5xxl_max_token_length`` tokens (77 + 256 = 333 x 4096 for SD3.5), and the two CLIPs' projected pooled outputs
side by side (768 + 1280 = 2048). ``apply_lg_attn_mask`` / ``apply_t5_attn_mask`` zero the padding positions of
the CLIP / T5 outputs, as sd-scripts does (the encoders themselves run unmasked)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sd_scripts_compat.errors import UserError

if TYPE_CHECKING:
    import torch

    from sd_scripts_compat.models.build import ModelBundle
    from sd_scripts_compat.models.text_encoding import TextConditioning

CLIP_TOKENS = 77


def tokenize_sd3(bundle: ModelBundle, captions: list[str], t5xxl_max_token_length: int | None
                 ) -> dict[str, torch.Tensor]:
    """Ids and masks per encoder, keyed by its file option (``clip_l``, ``clip_g``, ``t5xxl``)."""
    from sd_scripts_compat.models.t5_tokenizer import missing_tokenizer_message
    from sd_scripts_compat.models.text_encoding import check_t5xxl_max_token_length

    out: dict[str, torch.Tensor] = {}
    for spec, tokenizer in zip(bundle.family.text_encoders, bundle.tokenizers, strict=True):
        if tokenizer is None:
            raise UserError(missing_tokenizer_message(bundle.extra.get("t5xxl")))
        length = CLIP_TOKENS if spec.tokenizer_kind == "clip" else check_t5xxl_max_token_length(
            t5xxl_max_token_length, bundle.family.t5xxl_max_token_length)
        tokens = tokenizer(captions, max_length=length, padding="max_length", truncation=True, return_tensors="pt")
        out[spec.file_option], out[f"{spec.file_option}_mask"] = tokens.input_ids, tokens.attention_mask
    return out


def encode_sd3_tokens(bundle: ModelBundle, ids: dict[str, torch.Tensor], *, apply_lg_attn_mask: bool = False,
                      apply_t5_attn_mask: bool = False, dtype: Any = None) -> TextConditioning:
    """The context (B, 77 + T5 tokens, T5 width) and pooled vector (B, CLIP-L + CLIP-G projections); keeps
    autograd (a text-encoder LoRA trains through it)."""
    import torch
    import torch.nn.functional as F

    from sd_scripts_compat.models.text_encoding import TextConditioning

    clip_states, pooled, t5 = [], [], None
    for spec, encoder in zip(bundle.family.text_encoders, bundle.text_encoders, strict=True):
        device = next(encoder.parameters()).device
        key = spec.file_option
        mask = ids[f"{key}_mask"].to(device).unsqueeze(-1)
        if spec.tokenizer_kind == "t5":
            t5 = encoder(ids[key].to(device), return_dict=True).last_hidden_state
            t5 = t5 * mask if apply_t5_attn_mask else t5
            continue
        out = encoder(ids[key].to(device), output_hidden_states=True, return_dict=True)
        hidden = out.hidden_states[-2]
        clip_states.append(hidden * mask if apply_lg_attn_mask else hidden)
        pooled.append(out.text_embeds)
    assert t5 is not None, "an SD3 family has a T5 encoder"
    lg = torch.cat([s.to(t5.device) for s in clip_states], dim=-1)
    context = torch.cat([F.pad(lg, (0, t5.shape[-1] - lg.shape[-1])), t5], dim=1)
    vector = torch.cat([p.to(t5.device) for p in pooled], dim=-1)
    if dtype is not None:
        context, vector = context.to(dtype), vector.to(dtype)
    return TextConditioning(context, vector)
