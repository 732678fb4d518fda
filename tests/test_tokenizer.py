"""The shipped CLIP tokenizer equals a transformers CLIPTokenizer built independently from vocab + merges."""

from __future__ import annotations

import json

import pytest

from sd_scripts_compat.facts.families import CLIP_TOKENIZER_DIR, get_family
from sd_scripts_compat.models.build import load_tokenizer

PROMPTS = [
    "a photo of",
    "a photo of a cat sitting on a red sofa, highly detailed, 4k",
    "Hello, world!!! (masterpiece:1.2), [bad hands]; it's {ok} -- 3.14 / 50% #tag @user",
    "café crème brûlée, naïve façade, Ångström, Œuvre",
    "東京の夜景、桜の花びら、猫",
    "a smiling face 😀 with a rocket 🚀 and a flag 🇯🇵",
    "<lora:my_style_v2:0.8> portrait of sks person, <lora:detail-tweaker:-0.3>",
    "   multiple   spaces\tand\nnewlines   ",
    "",
    " ".join(f"word{i} and more" for i in range(120)),  # far beyond 77 tokens
]


@pytest.fixture(scope="module")
def reference():
    """A CLIPTokenizer made directly from the vocabulary data, not through our loader's from_pretrained route."""
    from transformers import CLIPTokenizer

    vocab = json.loads((CLIP_TOKENIZER_DIR / "vocab.json").read_text(encoding="utf-8"))
    lines = (CLIP_TOKENIZER_DIR / "merges.txt").read_text(encoding="utf-8").splitlines()
    merges = [tuple(line.split()) for line in lines if line and not line.startswith("#version")]
    assert len(vocab) == 49408 and len(merges) == 48894
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)


@pytest.fixture(scope="module")
def ours():
    return load_tokenizer()


def _ids(tokenizer, prompt, padding="max_length"):
    return tokenizer(prompt, padding=padding, truncation=True, max_length=77)["input_ids"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_ids_equal_independent_tokenizer(ours, reference, prompt):
    assert _ids(ours, prompt, padding=False) == _ids(reference, prompt, padding=False)


def test_known_ids(ours):
    assert ours("a photo of")["input_ids"] == [49406, 320, 1125, 539, 49407]


def test_long_prompt_truncated_to_77(ours):
    ids = _ids(ours, PROMPTS[-1])
    assert len(ids) == 77
    assert ids[0] == 49406 and ids[-1] == 49407
    assert len(ours(PROMPTS[-1])["input_ids"]) > 77  # without truncation it really is longer


def test_sdxl_tokenizers_pad_differently():
    family = get_family("sdxl")
    first, second = (load_tokenizer(pad_token=te.tokenizer["pad_token"], max_length=te.tokenizer["model_max_length"])
                     for te in family.text_encoders)
    ids1 = _ids(first, "a photo of")
    ids2 = _ids(second, "a photo of")
    assert ids1[:5] == ids2[:5] == [49406, 320, 1125, 539, 49407]
    assert first.pad_token_id == 49407 and set(ids1[5:]) == {49407}
    assert second.pad_token == "!" and second.pad_token_id == 0 and set(ids2[5:]) == {0}
    assert len(ids1) == len(ids2) == 77


def test_model_folder_tokenizer_keeps_its_pad_token(tmp_path):
    """A diffusers folder's own tokenizer (here one padding with '!') is used as saved."""
    load_tokenizer(pad_token="!").save_pretrained(tmp_path)
    tokenizer = load_tokenizer(str(tmp_path), pad_token=None)
    assert tokenizer.pad_token == "!"
    assert _ids(tokenizer, "a photo of")[5:7] == [0, 0]
