"""Our SD3.5 LoRA in diffusers: the kohya file itself is refused by diffusers' SD3 pipeline (its loader has no
kohya converter: nothing of it would apply), so ``autotune inspect LORA --diffusers-out COPY`` writes a copy under
diffusers' peft names, which ``StableDiffusion3Pipeline.load_lora_weights`` takes with every key used; the
MMDiT's output and both CLIP pooled outputs then equal our network's.

Tolerance: max |ours - diffusers| <= 1e-5 absolute, while the LoRA's own effect on each output is > 1e-3. The
model is ``builtin:tiny-sd3`` (SD3.5 Medium's layout: MMDiT-X block 0, a pre-only last context block)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures.diffusers_load import load_lora_complaints
from fixtures.engine_runs import ENV
from test_flux_lora_file import ATOL, _facts, _randomized_network

from sd_scripts_compat.facts.families import get_family
from sd_scripts_compat.models.build import build_modules
from sd_scripts_compat.network.lora import FusedLoRAModule
from sd_scripts_compat.network.lora_file import build_metadata, save_lora_file

ROOT = Path(__file__).resolve().parents[1]


def _inputs(bundle):
    gen = torch.Generator().manual_seed(11)
    config = bundle.unet.config
    return {"hidden_states": torch.randn(2, config.in_channels, 8, 8, generator=gen),
            "encoder_hidden_states": torch.randn(2, 6, config.joint_attention_dim, generator=gen),
            "pooled_projections": torch.randn(2, config.pooled_projection_dim, generator=gen),
            "timestep": torch.tensor([250.0, 750.0])}


def _outputs(bundle, ids, inputs):
    with torch.no_grad():
        return (bundle.unet(**inputs).sample, bundle.text_encoders[0](ids).text_embeds,
                bundle.text_encoders[1](ids).text_embeds)


@pytest.mark.slow
def test_diffusers_sd3_pipeline_loads_our_lora_through_the_copy(tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
    from peft.tuners.lora import LoraLayer

    bundle = build_modules(get_family("tiny-sd3"), seed=0)
    network = _randomized_network(bundle)  # MMDiT + CLIP-L + CLIP-G modules (T5 only with train_t5xxl)
    path = tmp_path / "sd3_lora.safetensors"
    save_lora_file(path, network.kohya_state_dict(), build_metadata(bundle.family, _facts()))
    ids = bundle.tokenizers[0](["a photo of sks dog", "grass"], padding="max_length", max_length=77,
                               return_tensors="pt").input_ids
    inputs = _inputs(bundle)
    base = _outputs(bundle, ids, inputs)
    network.apply_to()
    ours = _outputs(bundle, ids, inputs)
    network.remove()
    assert all((o - b).abs().max() > 1e-3 for o, b in zip(ours, base, strict=True))

    pipe = StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler.from_config(bundle.scheduler_config), vae=bundle.vae,
        text_encoder=bundle.text_encoders[0], tokenizer=bundle.tokenizers[0], text_encoder_2=bundle.text_encoders[1],
        tokenizer_2=bundle.tokenizers[1], text_encoder_3=bundle.text_encoders[2], tokenizer_3=bundle.tokenizers[2],
        transformer=bundle.unet)
    kohya_state = pipe.lora_state_dict(str(path))  # the kohya file as diffusers reads it: no name it knows
    assert not any(k.startswith(("transformer.", "text_encoder")) for k in kohya_state)

    copy = tmp_path / "sd3_lora_diffusers.safetensors"
    result = subprocess.run([sys.executable, "-m", "autotune", "inspect", str(path), "--diffusers-out", str(copy)],
                            capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"wrote {copy}" in result.stdout and result.stderr == ""
    assert load_lora_complaints(pipe, copy) == []
    expected_layers = sum(len(lora.targets.parts) if isinstance(lora, FusedLoRAModule) else 1
                          for lora in network.unet_loras)
    assert sum(isinstance(m, LoraLayer) for m in bundle.unet.modules()) == expected_layers
    for index in (0, 1):
        assert sum(isinstance(m, LoraLayer) for m in bundle.text_encoders[index].modules()) == len(
            [lora for lora in network.loras() if lora.lora_name.startswith(f"lora_te{index + 1}_")])
    theirs = _outputs(bundle, ids, inputs)
    errors = [(t - o).abs().max().item() for t, o in zip(theirs, ours, strict=True)]
    print(f"max |ours - diffusers| MMDiT {errors[0]:.2e}, CLIP-L {errors[1]:.2e}, CLIP-G {errors[2]:.2e}")
    assert max(errors) <= ATOL


def test_copy_of_a_lora_is_refused_in_one_line_when_it_would_overwrite(tmp_path):
    bundle = build_modules(get_family("tiny-sd3"), seed=0)
    path = tmp_path / "lora.safetensors"
    save_lora_file(path, _randomized_network(bundle).kohya_state_dict(), build_metadata(bundle.family, _facts()))
    for out, said in ((path, "would overwrite the LoRA it is made from"),
                      (tmp_path / "copy.bin", "ending in .safetensors")):
        result = subprocess.run([sys.executable, "-m", "autotune", "inspect", str(path), "--diffusers-out", str(out)],
                                capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300)
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert said in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora.safetensors"]


@pytest.mark.parametrize("name", ["tiny-sd3", "sd3.5-medium", "sd3.5-large"])
def test_inspect_knows_an_sd3_lora_of_the_mmdit_alone(name):
    """A UNet-only SD3.5 LoRA (no text-encoder keys to tell it by) was "an SD 1.x/2.x-layout model", family
    unknown, and --diffusers-out refused it: its joint_blocks keys (the family data's block table) and its hidden
    width now name the family, without the metadata too."""
    from sd_scripts_compat.network.lora import create_network
    from sd_scripts_compat.network.lora_file import describe_lora
    from sd_scripts_compat.network.lora_header import TensorInfo

    bundle = build_modules(get_family(name), device="meta", seed=None)  # full size: shapes only, as a header reads
    network = create_network(bundle, network_dim=4, network_alpha=4.0, train_text_encoder=False)
    state = {key: TensorInfo(tuple(value.shape), "fp32", 4.0 if key.endswith(".alpha") else None)
             for key, value in network.kohya_state_dict().items()}
    assert not any(key.startswith("lora_te") for key in state)
    info = describe_lora(state)
    assert info["family"] == name and info["unet_names"] == "table", info["family_label"]


def test_inspect_writes_the_diffusers_copy_of_a_unet_only_sd3_lora(tmp_path):
    from sd_scripts_compat.network.lora import create_network

    bundle = build_modules(get_family("tiny-sd3"), seed=0)
    path = tmp_path / "unet_only.safetensors"
    network = create_network(bundle, network_dim=4, network_alpha=4.0, train_text_encoder=False)
    save_lora_file(path, network.kohya_state_dict(), build_metadata(bundle.family, _facts()))
    copy = tmp_path / "copy.safetensors"
    result = subprocess.run([sys.executable, "-m", "autotune", "inspect", str(path), "--diffusers-out", str(copy)],
                            capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"wrote {copy}" in result.stdout and "tiny-sd3" in result.stdout
    # the copy keeps the training metadata (issue 52: conversions we write), its hashes its own
    import hashlib

    from safetensors import safe_open
    from safetensors.torch import save

    with safe_open(str(path), framework="pt") as handle:
        source = handle.metadata()
    with safe_open(str(copy), framework="pt") as handle:
        written, tensors = handle.metadata(), {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    training = {k for k in source if k.startswith(("ss_", "modelspec."))}
    assert len(training) > 40 and {k: written[k] for k in training} == {k: source[k] for k in training}
    buffer = save(tensors, {k: v for k, v in written.items() if k.startswith("ss_")})
    header = int.from_bytes(buffer[:8], "little")
    assert written["sshs_model_hash"] == hashlib.sha256(buffer[8 + header:]).hexdigest() != source["sshs_model_hash"]
    assert written["sshs_legacy_hash"] == hashlib.sha256(buffer[0x100000:0x110000]).hexdigest()[:8]
