"""Caption reading and per-step caption processing, reproducible from a seed."""

from __future__ import annotations

import random

import pytest

from sd_scripts_compat.dataset.captions import base_caption, process_caption, read_caption, tag_frequency
from sd_scripts_compat.facts.dataset_spec import SubsetSpec
from sd_scripts_compat.facts.errors import UserError

CAPTION = "sks dog, red collar, grass, sunny day, outdoors, photo"


def test_reading_first_line_class_tokens_and_missing(tmp_path):
    image = tmp_path / "a.png"
    (tmp_path / "a.txt").write_text("first line, tags  \nsecond line\n", encoding="utf-8")
    assert read_caption(image, ".txt") == "first line, tags"
    assert read_caption(image, ".caption") is None
    subset = SubsetSpec(str(tmp_path), class_tokens="sks dog", caption_extension=".caption")
    assert base_caption(image, subset) == ("sks dog", True)
    with pytest.warns(UserWarning, match="empty caption"):
        assert base_caption(image, SubsetSpec(str(tmp_path), caption_extension=".caption")) == ("", True)
    (tmp_path / "b.txt").write_text("", encoding="utf-8")
    with pytest.raises(UserError, match="b.txt"):
        read_caption(tmp_path / "b.png", ".txt")
    (tmp_path / "c.txt").write_bytes(b"\xff\xfe bad")
    with pytest.raises(UserError, match="c.txt"):
        read_caption(tmp_path / "c.png", ".txt")


def test_prefix_suffix_without_randomness():
    subset = SubsetSpec("x", caption_prefix="masterpiece", caption_suffix="end")
    assert process_caption("a cat", subset, random.Random(0)) == "masterpiece a cat end"


def test_shuffle_keeps_tokens_and_is_seeded():
    subset = SubsetSpec("x", shuffle_caption=True, keep_tokens=2)
    results = {process_caption(CAPTION, subset, random.Random(seed)) for seed in range(30)}
    assert len(results) > 5
    for result in results:
        tags = result.split(", ")
        assert tags[:2] == ["sks dog", "red collar"]
        assert sorted(tags) == sorted(t.strip() for t in CAPTION.split(","))
    assert process_caption(CAPTION, subset, random.Random(7)) == process_caption(CAPTION, subset, random.Random(7))


def test_keep_tokens_separator_with_fixed_suffix():
    subset = SubsetSpec("x", shuffle_caption=True, keep_tokens_separator="|||")
    caption = "sks, dog ||| a, b, c, d ||| suffix1, suffix2"
    for seed in range(10):
        tags = process_caption(caption, subset, random.Random(seed)).split(", ")
        assert tags[:2] == ["sks", "dog"] and tags[-2:] == ["suffix1", "suffix2"]
        assert sorted(tags[2:-2]) == ["a", "b", "c", "d"]


def test_custom_separator_and_output_join():
    subset = SubsetSpec("x", shuffle_caption=True, caption_separator=";")
    out = process_caption("a; b; c", subset, random.Random(1))
    assert sorted(out.split(", ")) == ["a", "b", "c"]


def test_caption_dropout_rate_and_every_n_epochs():
    subset = SubsetSpec("x", caption_dropout_rate=0.5)
    outs = [process_caption(CAPTION, subset, random.Random(s)) for s in range(200)]
    dropped = outs.count("")
    assert 60 < dropped < 140 and set(outs) == {"", CAPTION}
    every = SubsetSpec("x", caption_dropout_every_n_epochs=3)
    assert process_caption(CAPTION, every, random.Random(0), epoch=3) == ""
    assert process_caption(CAPTION, every, random.Random(0), epoch=4) == CAPTION


def test_tag_dropout_keeps_fixed_tokens():
    subset = SubsetSpec("x", caption_tag_dropout_rate=0.5, keep_tokens=1)
    lengths = set()
    for seed in range(50):
        tags = process_caption(CAPTION, subset, random.Random(seed)).split(", ")
        assert tags[0] == "sks dog"
        lengths.add(len(tags))
    assert min(lengths) < 6 and max(lengths) > 1


def test_token_warmup_grows_with_step():
    subset = SubsetSpec("x", token_warmup_min=1, token_warmup_step=10)
    assert process_caption(CAPTION, subset, random.Random(0), step=0) == "sks dog"
    assert len(process_caption(CAPTION, subset, random.Random(0), step=5).split(", ")) == 3
    assert process_caption(CAPTION, subset, random.Random(0), step=10) == CAPTION


def test_tag_frequency_lowercases_and_counts():
    counts = tag_frequency(["A, b", "a, c,", ""])
    assert counts == {"a": 2, "b": 1, "c": 1}
