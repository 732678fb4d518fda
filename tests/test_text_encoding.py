"""Text encoding shapes and long-prompt rules on the tiny SD1.5 / SDXL models; TE output caching."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from sd_scripts_compat.caching.text_cache import cache_text_encoder_outputs
from sd_scripts_compat.dataset.train_dataset import build_dataset
from sd_scripts_compat.facts.dataset_spec import DatasetSpec, SubsetSpec
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import get_family
from sd_scripts_compat.models.build import build_modules
from sd_scripts_compat.models.text_encoding import sdxl_time_ids, tokenize
from sd_scripts_compat.runtimes import TextOptions, encode_prompts

LONG = ", ".join(f"tag{i} word{i}" for i in range(60))  # well over 75 tokens


@pytest.fixture(scope="module")
def sd15():
    return build_modules(get_family("tiny-sd15"))


@pytest.fixture(scope="module")
def sdxl():
    return build_modules(get_family("tiny-sdxl"))


def test_tokenize_chunks_follow_kohya_rules(sdxl):
    tok1, tok2 = sdxl.tokenizers
    ids = tokenize(tok1, ["a cat", LONG], 225)
    assert ids.shape == (2, 3, 77)
    assert (ids[:, :, 0] == tok1.bos_token_id).all()
    assert (ids[:, :, -1] == tok1.eos_token_id).all()  # SD1-style: pad is EOS
    ids2 = tokenize(tok2, ["a cat", LONG], 225)
    assert tok2.pad_token_id != tok2.eos_token_id
    for row in ids2:
        for chunk in row:  # every window holds an EOS
            assert (chunk == tok2.eos_token_id).any()
    # the short prompt's empty 2nd/3rd windows are <BOS> <EOS> <PAD>...
    assert ids2[0, 1, 1] == tok2.eos_token_id and ids2[0, 1, 2] == tok2.pad_token_id
    assert tokenize(tok1, ["a cat"], None).shape == (1, 1, 77)
    with pytest.raises(UserError, match="max_token_length"):
        tokenize(tok1, ["a"], 100)


@pytest.mark.parametrize("length,tokens", [(None, 77), (75, 77), (150, 152), (225, 227)])
def test_sd15_shapes(sd15, length, tokens):
    out = encode_prompts(sd15, ["a cat", LONG], TextOptions(max_token_length=length))
    assert out.encoder_hidden_states.shape == (2, tokens, 32) and out.pooled is None


def test_sd15_clip_skip_is_layer_then_final_norm(sd15):
    encoder = sd15.text_encoders[0]
    ids = tokenize(sd15.tokenizers[0], ["a cat"], None)[:, 0]
    with torch.no_grad():
        out = encoder(ids, output_hidden_states=True)
        skip2 = encode_prompts(sd15, ["a cat"], TextOptions(clip_skip=2)).encoder_hidden_states
        skip1 = encode_prompts(sd15, ["a cat"], TextOptions(clip_skip=1)).encoder_hidden_states
    torch.testing.assert_close(skip2, encoder.final_layer_norm(out.hidden_states[-2]))
    torch.testing.assert_close(skip1, out.last_hidden_state)
    assert not torch.allclose(skip1, skip2)


@pytest.mark.parametrize("length,tokens", [(75, 77), (225, 227)])
def test_sdxl_shapes_and_pooled(sdxl, length, tokens):
    with torch.no_grad():
        out = encode_prompts(sdxl, ["a cat", LONG], TextOptions(max_token_length=length))
    assert out.encoder_hidden_states.shape == (2, tokens, 64)  # 32 + 32 features
    assert out.pooled.shape == (2, 32)
    # pooled == transformers' text_embeds of the first window (EOS is the largest id there)
    ids2 = tokenize(sdxl.tokenizers[1], ["a cat", LONG], length)[:, 0]
    with torch.no_grad():
        reference = sdxl.text_encoders[1](ids2).text_embeds
    torch.testing.assert_close(out.pooled, reference)
    # TE1 part is the penultimate layer without the final norm
    ids1 = tokenize(sdxl.tokenizers[0], ["a cat"], length)[:, 0]
    with torch.no_grad():
        penultimate = sdxl.text_encoders[0](ids1, output_hidden_states=True).hidden_states[-2]
    torch.testing.assert_close(out.encoder_hidden_states[:1, :76, :32], penultimate[:, :76])


def test_long_prompt_join_keeps_bos_content_and_last(sd15):
    ids = tokenize(sd15.tokenizers[0], [LONG], 150)
    with torch.no_grad():
        states = sd15.text_encoders[0](ids[0]).last_hidden_state  # (2, 77, D)
        joined = encode_prompts(sd15, [LONG], TextOptions(max_token_length=150)).encoder_hidden_states[0]
    torch.testing.assert_close(joined[0], states[0, 0])
    torch.testing.assert_close(joined[1:76], states[0, 1:76])
    torch.testing.assert_close(joined[76:151], states[1, 1:76])
    torch.testing.assert_close(joined[151], states[1, -1])


def test_sdxl_time_ids():
    ids = sdxl_time_ids(torch.tensor([[768, 1024]]), torch.tensor([[16, 0]]), torch.tensor([[704, 1024]]))
    assert ids.tolist() == [[768.0, 1024.0, 16.0, 0.0, 704.0, 1024.0]]


def _dataset(tmp_path, **subset_kwargs):
    folder = tmp_path / "1_x"
    folder.mkdir(exist_ok=True)
    for i in range(3):
        if not (folder / f"{i}.png").exists():
            Image.new("RGB", (64, 64), (i * 50, 0, 0)).save(folder / f"{i}.png")
            (folder / f"{i}.txt").write_text(["a cat", "a dog", "a cat"][i], encoding="utf-8")
    spec = DatasetSpec(subsets=(SubsetSpec(str(folder), caption_extension=".txt", **subset_kwargs),),
                       resolution=(64, 64), batch_size=3)
    return build_dataset(spec, seed=0)


def test_te_cache_equals_live_encoding_memory_and_disk(tmp_path, sdxl):
    memory = _dataset(tmp_path, caption_prefix="photo of")
    stats = cache_text_encoder_outputs(memory, sdxl, max_token_length=150, batch_size=2)
    assert stats.encoded == 2  # two distinct captions
    batch = memory.collate([0, 1, 2], epoch=0, step=0)
    with torch.no_grad():
        live = encode_prompts(sdxl, batch["captions"], TextOptions(max_token_length=150))
    assert batch["captions"][0] == "photo of a cat"
    torch.testing.assert_close(batch["encoder_hidden_states"], live.encoder_hidden_states, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(batch["pooled"], live.pooled, rtol=1e-5, atol=1e-6)
    disk = _dataset(tmp_path, caption_prefix="photo of")
    assert cache_text_encoder_outputs(disk, sdxl, max_token_length=150, to_disk=True).encoded == 2
    assert all(disk.text_files[r.index].is_file() for r in disk.records)
    again = _dataset(tmp_path, caption_prefix="photo of")
    stats = cache_text_encoder_outputs(again, sdxl, max_token_length=150, to_disk=True)
    assert (stats.encoded, stats.reused) == (0, 3)
    torch.testing.assert_close(again.collate([0, 1, 2], epoch=0, step=0)["encoder_hidden_states"],
                               batch["encoder_hidden_states"])
    # a different max_token_length invalidates the files
    assert cache_text_encoder_outputs(_dataset(tmp_path, caption_prefix="photo of"), sdxl, max_token_length=75,
                                      to_disk=True).reused == 0
    with pytest.raises(UserError, match="shuffle_caption"):
        cache_text_encoder_outputs(_dataset(tmp_path, shuffle_caption=True), sdxl)
