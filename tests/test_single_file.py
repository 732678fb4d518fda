"""Original single-file layout: write with save_single_file, read back with diffusers' converters, compare."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import get_family
from sd_scripts_compat.models.build import build_modules
from sd_scripts_compat.models.single_file import (
    Checkpoint,
    detect_family,
    expected_shapes,
    load_single_file,
    original_state_dict,
    save_single_file,
)
from sd_scripts_compat.runtimes import load_base_model


def _modules(bundle):
    return [("unet", bundle.unet), ("vae", bundle.vae)] + [
        (f"text_encoder{i}", te) for i, te in enumerate(bundle.text_encoders)]


def assert_bundles_equal(source, loaded):
    for (part, a), (_, b) in zip(_modules(source), _modules(loaded), strict=True):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys(), part
        for key in sa:
            assert sa[key].dtype == sb[key].dtype, (part, key)
            assert torch.equal(sa[key], sb[key]), (part, key)
        # nothing left on the meta device after loading (buffers included)
        assert all(t.device.type == "cpu" for t in [*b.parameters(), *b.buffers()]), part


def tiny_sd2_family(prediction_type="epsilon"):
    """An SD2-shaped family (OpenCLIP text encoder, linear projections) with tiny widths."""
    base = get_family("sd2" if prediction_type == "epsilon" else "sd2-v")
    tiny = get_family("tiny-sd15")
    unet = dict(base.unet, block_out_channels=[32, 64], layers_per_block=1, cross_attention_dim=32,
                attention_head_dim=[2, 4], down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
                up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"], sample_size=8)
    te = dict(base.text_encoders[0].config, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
              num_attention_heads=4)
    encoders = (dataclasses.replace(base.text_encoders[0], config=te),)
    return dataclasses.replace(base, name=f"test-tiny-{base.name}", unet=unet, vae=tiny.vae, text_encoders=encoders,
                               tiny=True)


@pytest.mark.parametrize("family", ["tiny-sd15", "tiny-sdxl"])
def test_round_trip_tiny(tmp_path, family):
    source = build_modules(get_family(family), seed=3)
    path = save_single_file(source, tmp_path / f"{family}.safetensors")
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # the temp file was renamed away
    loaded = load_base_model(str(path))
    assert loaded.family.name == family
    assert loaded.extra["format"] == "single_file"
    assert_bundles_equal(source, loaded)
    assert [t.pad_token for t in loaded.tokenizers] == [te.tokenizer["pad_token"]
                                                      for te in get_family(family).text_encoders]


def test_file_has_original_layout(tmp_path):
    source = build_modules(get_family("tiny-sdxl"), seed=0)
    path = save_single_file(source, tmp_path / "m.safetensors")
    with safe_open(str(path), framework="pt") as handle:
        keys = set(handle.keys())
        meta = handle.metadata()
        q = handle.get_slice("first_stage_model.encoder.mid.attn_1.q.weight").get_shape()
        in_proj = handle.get_slice("conditioner.embedders.1.model.transformer.resblocks.0.attn.in_proj_weight")
        proj = handle.get_slice("conditioner.embedders.1.model.text_projection").get_shape()
    assert "model.diffusion_model.input_blocks.3.1.transformer_blocks.0.attn1.to_q.weight" in keys
    assert "model.diffusion_model.label_emb.0.0.weight" in keys
    assert "conditioner.embedders.0.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight" in keys
    assert "first_stage_model.decoder.up.0.block.0.conv1.weight" in keys
    # four VAE levels, as in SD's own files: three downsamples (8x), the last level without one
    assert {"first_stage_model.encoder.down.2.downsample.conv.weight",
            "first_stage_model.encoder.down.3.block.0.conv1.weight",
            "first_stage_model.decoder.up.3.upsample.conv.weight"} <= keys
    assert "first_stage_model.encoder.down.3.downsample.conv.weight" not in keys
    assert not any(k.startswith(("unet.", "vae.", "down_blocks")) for k in keys)
    assert q == [32, 32, 1, 1]  # VAE attention stored as 1x1 convs (the last level's 32 channels)
    assert in_proj.get_shape() == [3 * 32, 32]  # fused q/k/v
    assert proj == [32, 32]
    assert meta["modelspec.architecture"] == "stable-diffusion-xl-v1-base"


def test_sd2_shaped_round_trip_drops_placeholder_block(tmp_path):
    family = tiny_sd2_family()
    source = build_modules(family, seed=5)
    path = save_single_file(source, tmp_path / "sd2.safetensors")
    with safe_open(str(path), framework="pt") as handle:
        keys = set(handle.keys())
    # the OpenCLIP layout holds one block more than the diffusers text encoder uses (as SD2's 24 vs 23)
    assert "cond_stage_model.model.transformer.resblocks.2.attn.in_proj_weight" in keys
    assert "cond_stage_model.model.transformer.resblocks.3.attn.in_proj_weight" not in keys
    assert "cond_stage_model.model.text_projection" in keys
    loaded = load_single_file(path, family=family)
    assert loaded.family.name == family.name
    assert_bundles_equal(source, loaded)


def test_sd2_v_marker_selects_v_family(tmp_path):
    eps, vpred = tiny_sd2_family("epsilon"), tiny_sd2_family("v_prediction")
    source = build_modules(vpred, seed=1)
    source.prediction_type = "v_prediction"
    path = save_single_file(source, tmp_path / "v.safetensors")
    loaded = load_single_file(path, family=vpred)
    assert loaded.prediction_type == "v_prediction"
    with safe_open(str(path), framework="pt") as handle:
        assert "v_pred" in set(handle.keys())
        assert handle.metadata()["modelspec.prediction_type"] == "v"
    assert_bundles_equal(source, loaded)
    from sd_scripts_compat.models.checkpoint import read_checkpoint

    checkpoint = read_checkpoint(path, header_only=True)
    assert detect_family(checkpoint, candidates=[eps, vpred]).name == vpred.name


def _shape_only_checkpoint(family_name, extra=(), metadata=None):
    shapes = dict(expected_shapes(get_family(family_name)))
    shapes.update(dict(extra))
    return Checkpoint(path=Path(f"{family_name}.safetensors"), shapes=shapes,
                      metadata=metadata or {}, tensors=None)


def test_detect_full_size_families_from_shapes():
    """Detection on the real full-size shapes (no tensor data needed)."""
    assert detect_family(_shape_only_checkpoint("sd15")).name == "sd15"
    assert detect_family(_shape_only_checkpoint("sdxl")).name == "sdxl"
    assert detect_family(_shape_only_checkpoint("sd2")).name == "sd2"
    assert detect_family(_shape_only_checkpoint("sd2", extra={"v_pred": (0,)})).name == "sd2-v"
    assert detect_family(_shape_only_checkpoint("sd2", metadata={"modelspec.prediction_type": "v"})).name == "sd2-v"
    # SD2 768-v files often carry no marker: the user's stated family decides
    assert detect_family(_shape_only_checkpoint("sd2"), stated=get_family("sd2-v")).name == "sd2-v"
    with pytest.raises(UserError, match="sd2-v checkpoint but family sd2 was requested"):
        detect_family(_shape_only_checkpoint("sd2", extra={"v_pred": (0,)}), stated=get_family("sd2"))
    with pytest.raises(UserError, match="sd15.safetensors is a sd15 checkpoint but family sdxl"):
        detect_family(_shape_only_checkpoint("sd15"), stated=get_family("sdxl"))


def test_sd2_cross_attention_width_is_1024():
    shapes = expected_shapes(get_family("sd2"))
    key = "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight"
    assert shapes[key] == (320, 1024)
    assert shapes["cond_stage_model.model.transformer.resblocks.0.attn.in_proj_weight"] == (3072, 1024)


def test_changed_width_matches_no_family(tmp_path):
    family = get_family("tiny-sd15")
    wider = dataclasses.replace(family, name="wider", unet=dict(family.unet, cross_attention_dim=48),
                                text_encoders=(dataclasses.replace(family.text_encoders[0], config=dict(
                                    family.text_encoders[0].config, hidden_size=48)),))
    path = save_single_file(build_modules(wider), tmp_path / "odd.safetensors")
    with pytest.raises(UserError, match="odd.safetensors looks like SD 1.x .* match no known family"):
        load_single_file(path)


def test_fp16_save_loads_as_float32(tmp_path):
    source = build_modules(get_family("tiny-sd15"), seed=2)
    path = save_single_file(source, tmp_path / "half.safetensors", dtype=torch.float16)
    with safe_open(str(path), framework="pt") as handle:
        assert handle.get_tensor("model.diffusion_model.out.2.weight").dtype == torch.float16
    loaded = load_single_file(path)
    expected = source.unet.state_dict()["conv_out.weight"].half().float()
    assert torch.equal(loaded.unet.state_dict()["conv_out.weight"], expected)
    assert loaded.unet.dtype == torch.float32
    loaded_half = load_single_file(path, dtype=torch.float16)
    assert loaded_half.unet.dtype == torch.float16


def test_meta_device_reads_header_only(tmp_path):
    path = save_single_file(build_modules(get_family("tiny-sdxl")), tmp_path / "m.safetensors")
    bundle = load_single_file(path, device="meta")
    assert bundle.family.name == "tiny-sdxl"
    assert next(bundle.unet.parameters()).device.type == "meta"


@pytest.mark.parametrize("name", ["sd15", "sd2", "sdxl"])
def test_full_size_layout_converts_back_on_meta(name):
    """Full-size families: our original layout, fed to diffusers' converters, gives every module key and shape."""
    import torch

    from sd_scripts_compat.models.single_file import _empty_bundle, convert_checkpoint

    family = get_family(name)
    with torch.device("meta"):
        bundle = _empty_bundle(family)
    parts = convert_checkpoint(original_state_dict(bundle, include_placeholders=False), family)
    modules = {"unet": bundle.unet, "vae": bundle.vae}
    modules.update({("text_encoder" if i == 0 else f"text_encoder_{i + 1}"): te
                    for i, te in enumerate(bundle.text_encoders)})
    assert set(parts) == set(modules)
    for part, module in modules.items():
        want = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        got = {k: tuple(v.shape) for k, v in parts[part].items()}
        assert got == want, part


def test_older_sd1_text_encoder_layout_is_converted_on_read(tmp_path):
    """SD 1.x files saved before transformers' ``text_model.`` level (``cond_stage_model.transformer.encoder.*``)
    load, as they do in sd-scripts and ComfyUI; the model equals the current layout's."""
    from safetensors.torch import load_file, save_file

    source = build_modules(get_family("tiny-sd15"))
    current = save_single_file(source, tmp_path / "current.safetensors")
    old = {k.replace("cond_stage_model.transformer.text_model.", "cond_stage_model.transformer."): v
           for k, v in load_file(str(current)).items()}
    assert any(k.startswith("cond_stage_model.transformer.encoder.") for k in old)
    save_file(old, str(tmp_path / "old.safetensors"))
    loaded = load_single_file(tmp_path / "old.safetensors")
    reference = load_single_file(current)
    assert loaded.family.name == "tiny-sd15"
    for ours, theirs in zip(loaded.text_encoders[0].state_dict().values(),
                            reference.text_encoders[0].state_dict().values()):
        assert torch.equal(ours, theirs)
