"""SD3 text encoding as sd-scripts' ``Sd3TextEncodingStrategy`` does it (48d368fa): ``apply_lg_attn_mask`` and
``apply_t5_attn_mask`` give the tokenizer's mask to the encoders themselves, and their outputs are kept (found by
``bench/equivalence.py``: we zeroed the padding outputs instead, and the context of every padded caption
differed)."""

from __future__ import annotations

import pytest
import torch

from sd_scripts_compat.models.text_encoding import tokenize_sd3
from sd_scripts_compat.runtimes import TextOptions, encode_prompts, load_base_model, runtime_for

CAPTIONS = ["a photo of sks dog", "a red chair in a garden, studio light, high quality, detailed portrait"]


@pytest.fixture(scope="module")
def tiny():
    return load_base_model("builtin:tiny-sd3")


def test_the_masks_go_into_the_encoders_and_their_outputs_are_kept(tiny):
    options = {"t5xxl_max_token_length": 24}
    ids = tokenize_sd3(tiny, CAPTIONS, 24)
    with torch.no_grad():
        plain = encode_prompts(tiny, CAPTIONS, TextOptions(**options))
        masked = encode_prompts(tiny, CAPTIONS, TextOptions(**options, apply_lg_attn_mask=True,
                                                            apply_t5_attn_mask=True))
        clip_l = tiny.text_encoders[0](ids["clip_l"], attention_mask=ids["clip_l_mask"], output_hidden_states=True)
        t5 = tiny.text_encoders[2](ids["t5xxl"], attention_mask=ids["t5xxl_mask"]).last_hidden_state
    real = int(ids["clip_l_mask"][0].sum())
    width_l = tiny.family.text_encoders[0].width
    context, context_plain = masked.encoder_hidden_states, plain.encoder_hidden_states
    # CLIP is causal: the caption's own positions and the pooled vector do not change; the padding does, and is
    # what the masked encoder computes (not zero)
    assert torch.equal(context[0, :real], context_plain[0, :real])
    assert torch.equal(masked.pooled, plain.pooled)
    assert not torch.allclose(context[0, real:77], context_plain[0, real:77])
    assert torch.equal(context[:, :77, :width_l], clip_l.hidden_states[-2])
    assert context[0, real:77, :width_l].abs().sum() > 0
    # T5 attends both ways: every position is the masked encoder's
    assert torch.equal(context[:, 77:, :], t5)


def test_a_text_cache_made_with_zeroed_padding_is_not_reused(tiny):
    runtime = runtime_for(tiny.family)
    plain = runtime.text_cache_key(TextOptions(t5xxl_max_token_length=24))
    masked = runtime.text_cache_key(TextOptions(t5xxl_max_token_length=24, apply_lg_attn_mask=True))
    assert plain == (24, "+t5_mask=False")
    assert masked == (24, "+t5_mask=False+lg_mask=True+masks_in_encoders")
