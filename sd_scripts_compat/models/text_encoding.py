"""Tokenizing and encoding captions as sd-scripts does (caching the outputs is ``caching.text_cache``).

- SD1/SD2 (``hidden_state == "last"``): the last hidden state; with ``clip_skip = k`` the output of
  layer -k passed through the final layer norm.
- SDXL (``"penultimate"``): each encoder's penultimate hidden state, without the final norm,
  concatenated on the feature axis; the pooled output (``text_embeds``) of the encoder that has a
  projection, taken at the first EOS token of the *first* 75-token chunk.
- ``max_token_length`` 150/225: the prompt is tokenized to max_token_length + 2, cut into 75-token
  chunks each wrapped as ``<BOS> chunk <EOS|PAD>`` (77 tokens), encoded chunk by chunk, and the
  outputs are joined back as ``BOS state + 75 states per chunk + last state`` (77/152/227 tokens).
- FLUX (a text encoder with ``hidden_state == "pooled"`` plus a T5 one, as sd-scripts' strategy_flux):
  CLIP-L's ``pooler_output`` (77 tokens, no long prompts) is the pooled vector; T5-XXL's last hidden
  state over ``t5xxl_max_token_length`` tokens (padded, truncated; family default dev 512 / schnell 256)
  conditions the transformer; ``apply_t5_attn_mask`` passes T5's attention mask to T5 (and returns it
  for the transformer's attention); ``txt_ids`` are zeros.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sd_scripts_compat.facts.errors import UserError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from sd_scripts_compat.models.build import ModelBundle

CHUNK = 75  # content tokens per 77-token window


@dataclass
class TextConditioning:
    encoder_hidden_states: torch.Tensor  # (B, tokens, features); FLUX: T5-XXL's last hidden state
    pooled: torch.Tensor | None = None  # (B, projection_dim): SDXL's projected CLIP-G, FLUX's CLIP-L pooler_output
    attention_mask: torch.Tensor | None = None  # FLUX: (B, tokens) T5 mask, 1 = caption token (kohya t5_attn_mask)
    txt_ids: torch.Tensor | None = None  # FLUX: (tokens, 3) zeros, as FluxTransformer2DModel takes them


def check_max_token_length(max_token_length: int | None) -> int:
    """None means 75. Only 75/150/225 are valid, as in sd-scripts."""
    if max_token_length is None:
        return CHUNK
    if max_token_length not in (75, 150, 225):
        raise UserError(f"max_token_length = {max_token_length} is not supported; use 75, 150 or 225")
    return max_token_length


def tokenize(tokenizer: PreTrainedTokenizerBase, captions: list[str],
             max_token_length: int | None = None) -> torch.Tensor:
    """Token ids shaped (B, chunks, 77) following sd-scripts' long-prompt rules.

    When the pad token is the EOS token (SD1) every chunk is ``BOS + 75 ids + last id``. Otherwise
    (pad "!", SDXL's second tokenizer) a chunk whose content runs to its end gets EOS as last id,
    and an empty chunk starts ``BOS EOS PAD...`` so every window holds an EOS.
    """
    import torch

    length = check_max_token_length(max_token_length)
    window = tokenizer.model_max_length
    ids = tokenizer(captions, padding="max_length", truncation=True, max_length=length + 2,
                    return_tensors="pt").input_ids
    if length + 2 <= window:
        return ids.unsqueeze(1)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    rows = []
    for row in ids:
        chunks = []
        for start in range(1, length + 2 - window + 2, window - 2):
            chunk = torch.cat([row[:1], row[start: start + window - 2], row[-1:]])
            if pad != eos:
                if chunk[-2] != eos and chunk[-2] != pad:
                    chunk[-1] = eos
                if chunk[1] == pad:
                    chunk[1] = eos
            chunks.append(chunk)
        rows.append(torch.stack(chunks))
    return torch.stack(rows)


def _join_chunks(states: torch.Tensor, batch: int, window: int) -> torch.Tensor:
    """(B*n, 77, D) -> (B, 75n + 2, D): first BOS state, the 75 content states of each window, last state."""
    import torch

    states = states.reshape(batch, -1, states.shape[-1])
    if states.shape[1] == window:
        return states
    parts = [states[:, :1]]
    parts += [states[:, start: start + window - 2] for start in range(1, states.shape[1], window)]
    parts.append(states[:, -1:])
    return torch.cat(parts, dim=1)


def _first_eos_positions(ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """Index of the first EOS per row (the last position when a row has none)."""
    is_eos = ids == eos_token_id
    first = is_eos.int().argmax(dim=-1)
    return first.where(is_eos.any(dim=-1), ids.shape[-1] - 1)


def _final_layer_norm(encoder: torch.nn.Module) -> torch.nn.Module:
    """transformers 5 puts ``final_layer_norm`` on the model itself; 4.x had it under ``text_model``."""
    norm = getattr(encoder, "final_layer_norm", None)
    return norm if norm is not None else encoder.get_submodule("text_model.final_layer_norm")


def encode_tokens(bundle: ModelBundle, token_ids: list[torch.Tensor], *, clip_skip: int | None = None,
                  dtype: torch.dtype | None = None) -> TextConditioning:
    """Encode ids from :func:`tokenize` (one tensor per text encoder). Keeps autograd, so a trained
    text encoder LoRA gets gradients; wrap in ``torch.no_grad()`` when it is frozen."""
    import torch

    specs = bundle.family.text_encoders
    if clip_skip is not None and clip_skip < 1:
        raise UserError(f"clip_skip = {clip_skip} must be >= 1")
    if clip_skip not in (None, 1) and any(s.hidden_state == "penultimate" for s in specs):
        warnings.warn("clip_skip is ignored for SDXL: it always uses the penultimate layer, as sd-scripts does",
                      stacklevel=2)
    hidden, pooled = [], None
    for spec, encoder, tokenizer, ids in zip(specs, bundle.text_encoders, bundle.tokenizers, token_ids):
        batch, _chunks, window = ids.shape
        flat = ids.reshape(-1, window).to(next(encoder.parameters()).device)
        out = encoder(flat, output_hidden_states=True, return_dict=True)
        if spec.hidden_state == "penultimate":
            states = out.hidden_states[-2]
        elif clip_skip is None or clip_skip == 1:
            states = out.last_hidden_state
        else:
            if clip_skip > len(out.hidden_states) - 1:
                raise UserError(f"clip_skip = {clip_skip} exceeds the text encoder's "
                                f"{len(out.hidden_states) - 1} layers")
            states = _final_layer_norm(encoder)(out.hidden_states[-clip_skip])
        hidden.append(_join_chunks(states, batch, window))
        projection = getattr(encoder, "text_projection", None)
        if projection is not None:
            last = out.last_hidden_state
            positions = _first_eos_positions(flat, tokenizer.eos_token_id)
            pooled_all = projection(last[torch.arange(last.shape[0], device=last.device), positions])
            pooled = pooled_all.reshape(batch, -1, pooled_all.shape[-1])[:, 0]
    states = torch.cat(hidden, dim=-1) if len(hidden) > 1 else hidden[0]
    if dtype is not None:
        states = states.to(dtype)
        pooled = pooled.to(dtype) if pooled is not None else None
    return TextConditioning(states, pooled)


def encode_clip_prompts(bundle: ModelBundle, captions: list[str], *, max_token_length: int | None = None,
                        clip_skip: int | None = None, dtype: torch.dtype | None = None) -> TextConditioning:
    """Tokenize and encode captions with every CLIP text encoder of the bundle (on their current devices): SD
    1.x/2.x and SDXL. Each family's runtime chooses its own encoding (``runtimes.encode_prompts``)."""
    ids = [tokenize(tokenizer, captions, max_token_length) for tokenizer in bundle.tokenizers]
    return encode_tokens(bundle, ids, clip_skip=clip_skip, dtype=dtype)


def check_t5xxl_max_token_length(value: int | None, family_default: int | None) -> int:
    """None means the family's default (dev 512, schnell 256); otherwise a positive token count."""
    if value is None:
        return int(family_default or 512)
    if not isinstance(value, int) or value < 1:
        raise UserError(f"t5xxl_max_token_length = {value!r} must be a positive integer (kohya: 512 for dev, "
                        "256 for schnell)")
    return value


def tokenize_flux(bundle: ModelBundle, captions: list[str],
                  t5xxl_max_token_length: int | None = None) -> dict[str, torch.Tensor]:
    """FLUX's ids as sd-scripts' FluxTokenizeStrategy makes them: ``clip`` (B, 1, 77), ``t5`` (B, L) and
    ``t5_mask`` (B, L); a missing T5 tokenizer is a one-line UserError saying where to put one."""
    from sd_scripts_compat.models.t5_tokenizer import missing_tokenizer_message

    out: dict[str, torch.Tensor] = {}
    for spec, tokenizer in zip(bundle.family.text_encoders, bundle.tokenizers, strict=True):
        if spec.tokenizer_kind != "t5":
            out["clip"] = tokenize(tokenizer, captions, None)
            continue
        if tokenizer is None:
            raise UserError(missing_tokenizer_message(bundle.extra.get("t5xxl")))
        length = check_t5xxl_max_token_length(t5xxl_max_token_length, bundle.family.t5xxl_max_token_length)
        tokens = tokenizer(captions, max_length=length, padding="max_length", truncation=True, return_tensors="pt")
        out["t5"], out["t5_mask"] = tokens.input_ids, tokens.attention_mask
    return out


def encode_flux_tokens(bundle: ModelBundle, ids: dict[str, torch.Tensor], *, apply_t5_attn_mask: bool = False,
                       dtype: torch.dtype | None = None) -> TextConditioning:
    """Encode :func:`tokenize_flux` ids: CLIP-L pooled output (none for Chroma) + T5 last hidden state (keeps
    autograd)."""
    import torch

    pooled = states = None
    for spec, encoder in zip(bundle.family.text_encoders, bundle.text_encoders, strict=True):
        device = next(encoder.parameters()).device
        if spec.tokenizer_kind == "t5":
            mask = ids["t5_mask"].to(device) if apply_t5_attn_mask else None
            states = encoder(ids["t5"].to(device), attention_mask=mask, return_dict=True).last_hidden_state
        else:
            pooled = encoder(ids["clip"].reshape(-1, ids["clip"].shape[-1]).to(device), return_dict=True).pooler_output
    assert states is not None  # a FLUX family has T5 (FLUX.1 also CLIP-L; Chroma only T5: no pooled vector)
    if dtype is not None:
        states, pooled = states.to(dtype), pooled.to(dtype) if pooled is not None else None
    txt_ids = torch.zeros(states.shape[1], 3, device=states.device, dtype=states.dtype)
    return TextConditioning(states, pooled, attention_mask=ids["t5_mask"].to(states.device), txt_ids=txt_ids)


# ---- SD3: sd-scripts' strategy_sd3 ----------------------------------------------------------------------
# CLIP-L and CLIP-G penultimate hidden states (77 tokens each) side by side on the feature axis, zero-padded to
# T5-XXL's width and followed by T5-XXL's ``t5xxl_max_token_length`` tokens (77 + 256 = 333 x 4096 for SD3.5), and
# the two CLIPs' projected pooled outputs side by side (768 + 1280 = 2048). ``apply_lg_attn_mask`` /
# ``apply_t5_attn_mask`` give the tokenizer's attention mask to the CLIP / T5 encoders, as sd-scripts'
# ``Sd3TextEncodingStrategy.encode_tokens`` does: padding is not attended to, and its own outputs are kept (the MMDiT
# takes no mask). CLIP is causal, so only the padding positions change; the pooled vector never does.

SD3_CLIP_TOKENS = 77


def tokenize_sd3(bundle: ModelBundle, captions: list[str], t5xxl_max_token_length: int | None
                 ) -> dict[str, torch.Tensor]:
    """Ids and masks per encoder, keyed by its file option (``clip_l``, ``clip_g``, ``t5xxl``)."""
    from sd_scripts_compat.models.t5_tokenizer import missing_tokenizer_message

    out: dict[str, torch.Tensor] = {}
    for spec, tokenizer in zip(bundle.family.text_encoders, bundle.tokenizers, strict=True):
        if tokenizer is None:
            raise UserError(missing_tokenizer_message(bundle.extra.get("t5xxl")))
        length = SD3_CLIP_TOKENS if spec.tokenizer_kind == "clip" else check_t5xxl_max_token_length(
            t5xxl_max_token_length, bundle.family.t5xxl_max_token_length)
        tokens = tokenizer(captions, max_length=length, padding="max_length", truncation=True, return_tensors="pt")
        key = spec.file_option or ""  # every SD3 encoder has one (clip_l, clip_g, t5xxl)
        out[key], out[f"{key}_mask"] = tokens.input_ids, tokens.attention_mask
    return out


def encode_sd3_tokens(bundle: ModelBundle, ids: dict[str, torch.Tensor], *, apply_lg_attn_mask: bool = False,
                      apply_t5_attn_mask: bool = False, dtype: torch.dtype | None = None) -> TextConditioning:
    """The context (B, 77 + T5 tokens, T5 width) and pooled vector (B, CLIP-L + CLIP-G projections); keeps
    autograd (a text-encoder LoRA trains through it)."""
    import torch
    import torch.nn.functional as F

    clip_states, pooled, t5 = [], [], None
    for spec, encoder in zip(bundle.family.text_encoders, bundle.text_encoders, strict=True):
        device = next(encoder.parameters()).device
        key = spec.file_option or ""
        masked = apply_t5_attn_mask if spec.tokenizer_kind == "t5" else apply_lg_attn_mask
        mask = ids[f"{key}_mask"].to(device) if masked else None
        if spec.tokenizer_kind == "t5":
            t5 = encoder(ids[key].to(device), attention_mask=mask, return_dict=True).last_hidden_state
            continue
        out = encoder(ids[key].to(device), attention_mask=mask, output_hidden_states=True, return_dict=True)
        clip_states.append(out.hidden_states[-2])
        pooled.append(out.text_embeds)
    assert t5 is not None, "an SD3 family has a T5 encoder"
    lg = torch.cat([s.to(t5.device) for s in clip_states], dim=-1)
    context = torch.cat([F.pad(lg, (0, t5.shape[-1] - lg.shape[-1])), t5], dim=1)
    vector = torch.cat([p.to(t5.device) for p in pooled], dim=-1)
    if dtype is not None:
        context, vector = context.to(dtype), vector.to(dtype)
    return TextConditioning(context, vector)


def sdxl_time_ids(original_sizes_hw: torch.Tensor, crop_top_lefts: torch.Tensor, target_sizes_hw: torch.Tensor,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """SDXL's size conditioning, (B, 6): original (h, w), crop (top, left), target (h, w); diffusers'
    UNet embeds it itself (``added_cond_kwargs={"text_embeds": pooled, "time_ids": ...}``)."""
    import torch

    time_ids = torch.cat([original_sizes_hw, crop_top_lefts, target_sizes_hw], dim=1)
    return time_ids.to(dtype) if dtype is not None else time_ids.float()
