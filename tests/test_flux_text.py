"""FLUX text encoding as sd-scripts' strategy_flux does it: CLIP-L pooled output, T5 hidden states over
t5xxl_max_token_length tokens, the T5 attention mask, txt_ids; T5 tokenizers only from local files."""

from __future__ import annotations

import pytest
import torch

from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.models.t5_tokenizer import find_t5_tokenizer, load_t5_tokenizer, train_unigram_t5_tokenizer
from sd_scripts_compat.models.text_encoding import tokenize_flux
from sd_scripts_compat.runtimes import TextOptions, encode_prompts, load_base_model

CAPTIONS = ["a photo of sks dog", "a red chair in a garden, studio light, high quality, detailed portrait"]


@pytest.fixture(scope="module")
def tiny():
    return load_base_model("builtin:tiny-flux")


def test_conditioning_shapes_and_pooled_output(tiny):
    with torch.no_grad():
        cond = encode_prompts(tiny, CAPTIONS, TextOptions(t5xxl_max_token_length=32))
        clip_ids = tiny.tokenizers[0](CAPTIONS, max_length=77, padding="max_length", truncation=True,
                                      return_tensors="pt").input_ids
        pooled = tiny.text_encoders[0](clip_ids).pooler_output
    assert cond.encoder_hidden_states.shape == (2, 32, tiny.family.text_encoders[1].width)
    assert cond.pooled.shape == (2, tiny.unet.config.pooled_projection_dim)
    assert torch.equal(cond.pooled, pooled)
    assert cond.txt_ids.shape == (32, 3) and not cond.txt_ids.any()
    assert cond.attention_mask.shape == (2, 32) and cond.attention_mask[0].sum() < cond.attention_mask[1].sum()
    # the family default: 512 tokens for the dev-shaped families
    ids = tokenize_flux(tiny, CAPTIONS)
    assert ids["t5"].shape == (2, 512) and ids["clip"].shape == (2, 1, 77)
    assert (ids["t5"][0, ids["t5_mask"][0].sum() - 1]).item() == 1  # </s> ends the caption


def test_apply_t5_attn_mask_changes_only_what_it_should(tiny):
    with torch.no_grad():
        plain = encode_prompts(tiny, CAPTIONS, TextOptions(t5xxl_max_token_length=24))
        masked = encode_prompts(tiny, CAPTIONS, TextOptions(t5xxl_max_token_length=24, apply_t5_attn_mask=True))
        alone = encode_prompts(tiny, CAPTIONS[:1], TextOptions(t5xxl_max_token_length=24, apply_t5_attn_mask=True))
    real = int(masked.attention_mask[0].sum())
    assert not torch.allclose(plain.encoder_hidden_states[0, :real], masked.encoder_hidden_states[0, :real])
    assert torch.equal(plain.pooled, masked.pooled)
    assert torch.allclose(alone.encoder_hidden_states[0], masked.encoder_hidden_states[0], atol=1e-6)
    with pytest.raises(UserError, match="t5xxl_max_token_length = 0 must be a positive integer"):
        encode_prompts(tiny, CAPTIONS, TextOptions(t5xxl_max_token_length=0))


def test_t5_tokenizer_is_found_locally_or_named_in_one_line(tmp_path, tiny):
    own = train_unigram_t5_tokenizer(["zebra crossing at night", "a zebra"], vocab_size=40, max_length=512)
    t5_file = tmp_path / "models" / "t5xxl_fp16.safetensors"
    t5_file.parent.mkdir()
    t5_file.write_bytes(b"")
    assert find_t5_tokenizer(None, t5_file) is None
    own.save_pretrained(str(t5_file.parent / "tokenizer_2"))
    assert find_t5_tokenizer(None, t5_file) == t5_file.parent / "tokenizer_2"
    named = tmp_path / "mine"
    own.save_pretrained(str(named))
    assert find_t5_tokenizer(str(named), t5_file) == named
    assert load_t5_tokenizer(named / "tokenizer.json", 77)("a zebra").input_ids == own("a zebra").input_ids
    junk = tmp_path / "spiece.model"
    junk.write_bytes(b"not a sentencepiece model")
    with pytest.raises(UserError, match="spiece.model: a T5 tokenizer is read from its tokenizer.json") as info:
        load_t5_tokenizer(junk, 512)
    assert "\n" not in str(info.value)
    (tmp_path / "models" / "tokenizer.json").write_text("{}")  # a bare tokenizer.json beside it may be CLIP's
    with pytest.raises(UserError, match="tokenizer.json: not a readable T5 tokenizer"):
        load_t5_tokenizer(tmp_path / "models" / "tokenizer.json", 512)
    (t5_file.parent / "tokenizer_2" / "tokenizer.json").rename(tmp_path / "moved.json")
    assert find_t5_tokenizer(None, t5_file) is None
    with pytest.raises(UserError, match="t5xxl_tokenizer = .*nowhere: no tokenizer.json or spiece.model there"):
        find_t5_tokenizer(str(tmp_path / "nowhere"), t5_file)
    no_tokenizer = load_base_model("builtin:tiny-flux")
    no_tokenizer.tokenizers[1] = None  # a full-size model without its tokenizer
    no_tokenizer.extra["t5xxl"] = str(t5_file)
    with pytest.raises(UserError, match=r"no T5 tokenizer found .* copy FLUX.1-dev's tokenizer_2/ folder .* to "
                                        r".*models/tokenizer_2 or name it with t5xxl_tokenizer") as info:
        encode_prompts(no_tokenizer, CAPTIONS)
    assert "\n" not in str(info.value)
