"""kohya LoRA files: round trips, precision casting, metadata, hashes, atomic writes, bad files."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile

import pytest
import torch
from safetensors.torch import save, save_file

from sd_scripts_compat.config.network_args import NetworkArgs
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import get_family
from sd_scripts_compat.models.build import build_modules
from sd_scripts_compat.network.lora import create_network
from sd_scripts_compat.network.lora_file import (
    TrainingFacts,
    build_metadata,
    describe_lora,
    read_lora_file,
    save_lora_file,
)


@pytest.fixture(scope="module")
def trained_state():
    """A tiny-sd15 LoRA (with LoCon) whose up weights are non-zero."""
    bundle = build_modules(get_family("tiny-sd15"))
    network = create_network(bundle, network_dim=4, network_alpha=2,
                             args=NetworkArgs(conv_dim=2, conv_alpha=1))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for lora in network.loras():
            lora.lora_up.weight.copy_(torch.randn(lora.lora_up.weight.shape, generator=generator))
    return network.kohya_state_dict()


def _facts(**overrides):
    values = dict(output_name="dog", network_dim=4, network_alpha=2.0, learning_rate=1e-4,
                  optimizer="torch.optim.adamw.AdamW(weight_decay=0.01)", resolution=(64, 64),
                  training_started_at=1767225600.5, session_id=123456789, network_args={"conv_dim": "2"},
                  seed=42, steps=10, epoch=1, training_finished_at=1767225700.25,
                  tag_frequency={"10_sks dog": {"sks dog": 5, "grass": 2}},
                  dataset_dirs={"10_sks dog": {"n_repeats": 10, "img_count": 5}})
    values.update(overrides)
    return TrainingFacts(**values)


@pytest.mark.parametrize("precision", [None, "float", "fp16", "bf16", torch.float16])
def test_save_read_round_trip(tmp_path, trained_state, precision):
    path = tmp_path / "dog.safetensors"
    save_lora_file(path, trained_state, {"ss_network_module": "networks.lora"}, save_dtype=precision)
    loaded, metadata = read_lora_file(path)
    want = {None: torch.float32, "float": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
            torch.float16: torch.float16}[precision]
    assert set(loaded) == set(trained_state)
    for key, value in trained_state.items():
        assert loaded[key].dtype == want, key
        assert torch.equal(loaded[key], value.to(want)), key  # bit-identical after the cast
    assert metadata["ss_network_module"] == "networks.lora"
    assert [p.name for p in tmp_path.iterdir()] == ["dog.safetensors"]  # no temp file left behind


def test_metadata_strings_and_content():
    metadata = build_metadata(get_family("sdxl"), _facts(clip_skip=2, extra={"noise_offset_type": "Original"}))
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    assert metadata["ss_network_module"] == "networks.lora"
    assert metadata["ss_network_dim"] == "4" and metadata["ss_network_alpha"] == "2.0"
    assert json.loads(metadata["ss_network_args"]) == {"conv_dim": "2"}
    assert metadata["ss_base_model_version"] == "sdxl_base_v1-0" and metadata["ss_v2"] == "False"
    assert metadata["ss_resolution"] == "(64, 64)"
    assert metadata["ss_text_encoder_lr"] == "None"
    assert metadata["ss_seed"] == "42" and metadata["ss_steps"] == "10" and metadata["ss_session_id"] == "123456789"
    assert json.loads(metadata["ss_tag_frequency"]) == {"10_sks dog": {"sks dog": 5, "grass": 2}}
    assert json.loads(metadata["ss_dataset_dirs"])["10_sks dog"]["n_repeats"] == 10
    assert metadata["ss_noise_offset_type"] == "Original"
    assert metadata["modelspec.sai_model_spec"] == "1.0.1"
    assert metadata["modelspec.architecture"] == "stable-diffusion-xl-v1-base/lora"
    assert metadata["modelspec.implementation"] == "https://github.com/Stability-AI/generative-models"
    assert metadata["modelspec.resolution"] == "64x64" and metadata["modelspec.title"] == "dog"
    assert metadata["modelspec.prediction_type"] == "epsilon" and metadata["modelspec.encoder_layer"] == "2"
    assert metadata["modelspec.date"].startswith("2026-01-01T") or metadata["modelspec.date"].startswith("2025-12-31T")
    v_meta = build_metadata(get_family("sd2-v"), _facts())
    assert v_meta["modelspec.architecture"] == "stable-diffusion-v2-768-v/lora"
    assert v_meta["modelspec.prediction_type"] == "v" and v_meta["ss_v2"] == "True"
    assert v_meta["modelspec.implementation"] == "diffusers"
    assert "ss_training_finished_at" not in build_metadata(get_family("sd15"), _facts(training_finished_at=None))


@pytest.mark.parametrize("precision", ["float", "fp16"])
def test_hashes_recomputed_from_file_bytes(tmp_path, precision):
    # > 1 MiB + 64 KiB of tensor data, so the legacy hash reads real bytes
    generator = torch.Generator().manual_seed(1)
    state = {"lora_unet_a.lora_down.weight": torch.randn(80, 8192, generator=generator),
             "lora_unet_a.lora_up.weight": torch.randn(64, 80, generator=generator),
             "lora_unet_a.alpha": torch.tensor(16.0)}
    metadata = build_metadata(get_family("sd15"), _facts())
    path = tmp_path / "h.safetensors"
    written = save_lora_file(path, state, metadata, save_dtype=precision)
    raw = path.read_bytes()
    header_len = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + header_len])
    assert header["__metadata__"] == written
    assert written["sshs_model_hash"] == hashlib.sha256(raw[8 + header_len:]).hexdigest()
    # legacy hash: the buffer holding the same tensors with only the ss_* metadata
    loaded, file_meta = read_lora_file(path)
    ss_only = {k: v for k, v in file_meta.items() if k.startswith("ss_")}
    buffer = save(loaded, ss_only)
    assert len(buffer) > 0x110000
    assert written["sshs_legacy_hash"] == hashlib.sha256(buffer[0x100000:0x110000]).hexdigest()[:8]
    assert written["sshs_model_hash"] == hashlib.sha256(buffer[8 + struct.unpack("<Q", buffer[:8])[0]:]).hexdigest()
    assert all(isinstance(v, str) for v in file_meta.values())


def test_int64_alpha_is_read_and_loaded(tmp_path, trained_state):
    state = {k: torch.tensor(2, dtype=torch.int64) if k.endswith(".alpha") else v for k, v in trained_state.items()}
    path = tmp_path / "int_alpha.safetensors"
    save_file(state, str(path))  # written the way a TOML-integer alpha ends up: int64
    loaded, metadata = read_lora_file(path)
    assert metadata == {}
    assert loaded["lora_te_text_model_encoder_layers_0_self_attn_q_proj.alpha"].dtype == torch.int64
    network = create_network(build_modules(get_family("tiny-sd15")), network_dim=4, network_alpha=1,
                             args=NetworkArgs(conv_dim=2, conv_alpha=1))
    network.load_kohya_state_dict(loaded)
    assert {lora.scale for lora in network.loras()} == {0.5, 1.0}
    info = describe_lora(loaded, metadata)
    assert info["alphas"] == {"2": len(network.loras())}


def test_missing_folder_is_user_error(tmp_path, trained_state):
    with pytest.raises(UserError, match="does not exist"):
        save_lora_file(tmp_path / "nope" / "x.safetensors", trained_state, {})
    not_a_dir = tmp_path / "file.txt"
    not_a_dir.write_text("x")
    with pytest.raises(UserError, match="file.txt"):
        save_lora_file(not_a_dir / "x.safetensors", trained_state, {})


def test_fake_unwritable_dir_is_user_error(tmp_path, trained_state, monkeypatch):
    """We run as root here, where chmod cannot make a folder unwritable: the OS error is injected."""
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.raises(UserError, match=r"x\.safetensors: cannot write \(Permission denied\)"):
        save_lora_file(tmp_path / "x.safetensors", trained_state, {})
    assert list(tmp_path.iterdir()) == []


def test_failed_replace_leaves_no_temp_and_keeps_old_file(tmp_path, trained_state, monkeypatch):
    path = tmp_path / "keep.safetensors"
    path.write_bytes(b"old")

    def fail_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail_replace)
    with pytest.raises(UserError, match="disk full while saving the LoRA keep.safetensors") as raised:
        save_lora_file(path, trained_state, {})
    assert raised.value.exit_code == 28 and str(tmp_path) in str(raised.value)  # DiskFullError, naming the folder
    assert [p.name for p in tmp_path.iterdir()] == ["keep.safetensors"]
    assert path.read_bytes() == b"old"


def test_not_a_lora_and_corrupt_files(tmp_path, trained_state):
    base = tmp_path / "model.safetensors"
    save_file({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(4, 4)}, str(base))
    with pytest.raises(UserError, match=r"model\.safetensors is not a kohya LoRA file: .*base model"):
        read_lora_file(base)
    peft = tmp_path / "peft.safetensors"
    save_file({"unet.down_blocks.0.attn.to_q.lora_A.weight": torch.zeros(2, 4)}, str(peft))
    with pytest.raises(UserError, match="diffusers/peft-format"):
        read_lora_file(peft)
    random_file = tmp_path / "random.safetensors"
    save_file({"foo": torch.zeros(3)}, str(random_file))
    with pytest.raises(UserError, match="random.safetensors is not a kohya LoRA"):
        read_lora_file(random_file)
    good = tmp_path / "good.safetensors"
    save_lora_file(good, trained_state, {})
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(UserError, match="truncated.safetensors: not a readable safetensors file"):
        read_lora_file(truncated)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\xff" * 64)
    with pytest.raises(UserError, match="garbage.safetensors"):
        read_lora_file(garbage)
    with pytest.raises(UserError, match="no such file"):
        read_lora_file(tmp_path / "absent.safetensors")


def test_describe_tiny_file(tmp_path, trained_state):
    path = tmp_path / "d.safetensors"
    save_lora_file(path, trained_state, build_metadata(get_family("tiny-sd15"), _facts()), save_dtype="fp16")
    info = describe_lora(*read_lora_file(path))
    assert info["family"] == "tiny-sd15"
    assert info["modules"] == {"total": 91, "unet": 79, "unet_conv3x3": 18, "text_encoders": {"lora_te": 12},
                               "other": 0}
    assert info["ranks"] == {"2": 18, "4": 73} and info["conv"] is True
    assert info["precision"] == {"fp16": 182}
    assert info["training"]["network module"] == "networks.lora"
