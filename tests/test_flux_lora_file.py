"""A FLUX LoRA file as sd-scripts writes it: kohya keys, FLUX metadata, ``autotune inspect`` names its family,
and diffusers' own FluxPipeline.load_lora_weights (built locally from the tiny parts, no hub) uses every key and
gives the transformer and CLIP-L the outputs our network gives.

Tolerance: max |ours - diffusers| <= 1e-5 absolute (diffusers rescales lora_A / lora_B by alpha), while the
LoRA's own effect on the outputs is > 1e-3. diffusers' kohya-FLUX converter hard-codes FLUX.1's widths for a
single block's linear1 ([3072, 3072, 3072, 12288]), so the diffusers check runs twice: the tiny family without
single blocks, and a FLUX.1-wide model (24 heads x 128) with one single block and nothing else large (~190 M
parameters). T5 LoRAs (lora_te3_) are left out of it: that converter knows lora_te1_ only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from fixtures.diffusers_load import load_lora_complaints

from sd_scripts_compat.facts.families import get_family
from sd_scripts_compat.models.build import build_modules
from sd_scripts_compat.network.lora import FusedLoRAModule, create_network
from sd_scripts_compat.network.lora_file import (
    TrainingFacts,
    build_metadata,
    describe_lora,
    read_lora_file,
    save_lora_file,
)
from sd_scripts_compat.runtimes import load_base_model

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = Path(__file__).parent / "data" / "kohya"
ATOL = 1e-5


def _facts() -> TrainingFacts:
    return TrainingFacts(output_name="flux_sks", network_dim=4, network_alpha=2.0, learning_rate=1e-4,
                         optimizer="torch.optim.adamw.AdamW", resolution=(256, 256), training_started_at=1.7e9,
                         session_id=3, steps=5, extra={"model_type": "flux", "guidance_scale": 3.5})


def _randomized_network(bundle):
    network = create_network(bundle, network_dim=4, network_alpha=2)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for lora in network.loras():
            lora.lora_up.weight.copy_(torch.randn(lora.lora_up.weight.shape, generator=gen) * 0.1)
    return network


@pytest.fixture(scope="module")
def flux_lora(tmp_path_factory):
    bundle = load_base_model("builtin:tiny-flux")
    network = _randomized_network(bundle)
    path = tmp_path_factory.mktemp("flux_lora") / "flux_sks.safetensors"
    save_lora_file(path, network.kohya_state_dict(), build_metadata(bundle.family, _facts()))
    return bundle, network, path


def test_metadata_as_sd_scripts_writes_for_flux(flux_lora):
    _bundle, _network, path = flux_lora
    state_dict, metadata = read_lora_file(path)
    assert metadata["ss_base_model_version"] == "flux1"
    assert metadata["modelspec.architecture"] == "flux-1-dev/lora"
    assert metadata["modelspec.implementation"] == "https://github.com/black-forest-labs/flux"
    assert "modelspec.prediction_type" not in metadata  # sd-scripts writes none for FLUX
    assert metadata["ss_model_type"] == "flux" and metadata["ss_guidance_scale"] == "3.5"
    assert metadata["ss_network_module"] == "networks.lora_flux"  # kohya's FLUX LoRA module
    assert describe_lora(state_dict, metadata)["family"] == "tiny-flux"
    schnell = build_metadata(get_family("flux-schnell"), _facts())
    assert schnell["modelspec.architecture"] == "flux-1-schnell/lora"


def test_file_loads_back_into_a_network_shaped_by_it(flux_lora):
    from sd_scripts_compat.network.lora import create_network_from_weights

    bundle, network, path = flux_lora
    again = create_network_from_weights(bundle, str(path))
    ours, theirs = network.kohya_state_dict(), again.kohya_state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert sum(isinstance(lora, FusedLoRAModule) for lora in again.loras()) == 6


def test_full_size_flux_lora_is_described_as_flux_dev():
    """The reference key list (shapes only: expanded zero tensors, nothing allocated) is FLUX.1; the
    metadata tells dev from schnell."""
    reference = json.loads((REFERENCE / "keys_flux_dev_t5.json").read_text())
    state_dict = {k: torch.tensor(8.0) if k.endswith(".alpha") else torch.zeros(1).expand(shape)
                  for k, (shape, _) in reference.items()}
    info = describe_lora(state_dict, {"modelspec.architecture": "flux-1-dev/lora"})
    assert info["family"] == "flux-dev"
    assert info["modules"]["unet"] == 304 and info["modules"]["text_encoders"] == {"lora_te1": 72, "lora_te3": 168}
    schnell = describe_lora(state_dict, {"modelspec.architecture": "flux-1-schnell/lora"})
    assert schnell["family"] == "flux-schnell"
    assert describe_lora(state_dict)["family_candidates"] == ["flux-dev", "flux-schnell"]


def test_autotune_inspect_reports_flux(flux_lora):
    env = dict(os.environ, HF_HUB_OFFLINE="1", COLUMNS="160")
    result = subprocess.run([sys.executable, "-m", "autotune", "inspect", str(flux_lora[2]), "--json"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["family"] == "tiny-flux" and info["metadata"]["ss_base_model_version"] == "flux1"


def _transformer_inputs(bundle):
    gen = torch.Generator().manual_seed(11)
    config = bundle.unet.config
    return {"hidden_states": torch.randn(2, 16, config.in_channels, generator=gen),
            "encoder_hidden_states": torch.randn(2, 6, config.joint_attention_dim, generator=gen),
            "pooled_projections": torch.randn(2, config.pooled_projection_dim, generator=gen),
            "timestep": torch.tensor([0.25, 0.75]), "guidance": torch.full((2,), 3.5),
            "img_ids": torch.zeros(16, 3), "txt_ids": torch.zeros(6, 3)}


def _outputs(bundle, ids, inputs):
    with torch.no_grad():
        return bundle.text_encoders[0](ids).pooler_output, bundle.unet(**inputs).sample


VARIANTS = {"tiny-double-blocks": {"num_single_layers": 0},
            "flux-wide-single-block": {"num_layers": 0, "num_single_layers": 1, "num_attention_heads": 24,
                                       "attention_head_dim": 128, "axes_dims_rope": [16, 56, 56]}}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_diffusers_flux_pipeline_loads_our_lora(tmp_path, variant):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
    from peft.tuners.lora import LoraLayer

    tiny = get_family("tiny-flux")
    bundle = build_modules(replace(tiny, unet={**tiny.unet, **VARIANTS[variant]}), seed=0)
    network = _randomized_network(bundle)
    path = tmp_path / "flux_lora.safetensors"
    save_lora_file(path, network.kohya_state_dict(), build_metadata(bundle.family, _facts()))
    ids = bundle.tokenizers[0](["a photo of sks dog", "grass"], padding="max_length", max_length=77,
                               return_tensors="pt").input_ids
    inputs = _transformer_inputs(bundle)
    base_pooled, base_out = _outputs(bundle, ids, inputs)
    network.apply_to()
    ours_pooled, ours_out = _outputs(bundle, ids, inputs)
    network.remove()
    assert (ours_out - base_out).abs().max() > 1e-3 and (ours_pooled - base_pooled).abs().max() > 1e-3

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(bundle.scheduler_config)
    pipe = FluxPipeline(scheduler=scheduler, vae=bundle.vae, text_encoder=bundle.text_encoders[0],
                        tokenizer=bundle.tokenizers[0], text_encoder_2=bundle.text_encoders[1],
                        tokenizer_2=bundle.tokenizers[1], transformer=bundle.unet)
    complaints = load_lora_complaints(pipe, path)
    assert complaints == []
    # every kohya module became LoRA layers: a fused one as one layer per diffusers Linear
    expected_layers = sum(len(lora.targets.parts) if isinstance(lora, FusedLoRAModule) else 1
                          for lora in network.unet_loras)
    assert sum(isinstance(m, LoraLayer) for m in bundle.unet.modules()) == expected_layers
    assert sum(isinstance(m, LoraLayer) for m in bundle.text_encoders[0].modules()) == network.text_encoder_modules
    theirs_pooled, theirs_out = _outputs(bundle, ids, inputs)
    out_error = (theirs_out - ours_out).abs().max().item()
    pooled_error = (theirs_pooled - ours_pooled).abs().max().item()
    print(f"{variant}: max |ours - diffusers| transformer {out_error:.2e}, CLIP-L pooled {pooled_error:.2e}")
    assert out_error <= ATOL and pooled_error <= ATOL
    pipe.unload_lora_weights()


def test_lora_of_another_family_is_refused_in_one_line(flux_lora):
    from sd_scripts_compat.facts.errors import UserError
    from sd_scripts_compat.network.lora import create_network_from_weights

    bundle, _network, path = flux_lora
    sd15 = build_modules(get_family("tiny-sd15"))
    with pytest.raises(UserError, match="this LoRA was made for tiny-flux, but the model is tiny-sd15"):
        create_network_from_weights(sd15, str(path))
    sd_lora = create_network(sd15, network_dim=2).kohya_state_dict()
    with pytest.raises(UserError, match="but the model is tiny-flux"):
        create_network_from_weights(bundle, sd_lora)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_diffusers_chroma_pipeline_loads_our_lora(tmp_path, variant):
    """diffusers' ChromaPipeline (its kohya-FLUX LoRA converter) takes our Chroma LoRA: every key used, the
    transformer's output equal to our network's (same tolerance and same width caveat as FLUX above)."""
    from diffusers import ChromaPipeline, FlowMatchEulerDiscreteScheduler
    from peft.tuners.lora import LoraLayer

    tiny = get_family("tiny-chroma")
    bundle = build_modules(replace(tiny, unet={**tiny.unet, **VARIANTS[variant]}), seed=0)
    network = _randomized_network(bundle)
    path = tmp_path / "chroma_lora.safetensors"
    facts = replace(_facts(), extra={"model_type": "chroma", "guidance_scale": 0.0})
    save_lora_file(path, network.kohya_state_dict(), build_metadata(bundle.family, facts))
    gen = torch.Generator().manual_seed(11)
    config = bundle.unet.config
    inputs = {"hidden_states": torch.randn(2, 16, config.in_channels, generator=gen),
              "encoder_hidden_states": torch.randn(2, 6, config.joint_attention_dim, generator=gen),
              "timestep": torch.tensor([0.25, 0.75]), "img_ids": torch.zeros(16, 3), "txt_ids": torch.zeros(6, 3)}
    with torch.no_grad():
        base = bundle.unet(**inputs).sample
        network.apply_to()
        ours = bundle.unet(**inputs).sample
        network.remove()
    assert (ours - base).abs().max() > 1e-3
    pipe = ChromaPipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(bundle.scheduler_config),
                          vae=bundle.vae, text_encoder=bundle.text_encoders[0], tokenizer=bundle.tokenizers[0],
                          transformer=bundle.unet)
    # the one thing it says: the file has no T5 LoRA (none was trained), so T5 gets none
    complaints = load_lora_complaints(pipe, path)
    assert [c for c in complaints if not c.startswith("No LoRA keys associated to T5EncoderModel")] == []
    expected_layers = sum(len(lora.targets.parts) if isinstance(lora, FusedLoRAModule) else 1
                          for lora in network.unet_loras)
    assert sum(isinstance(m, LoraLayer) for m in bundle.unet.modules()) == expected_layers
    with torch.no_grad():
        theirs = bundle.unet(**inputs).sample
    error = (theirs - ours).abs().max().item()
    print(f"chroma {variant}: max |ours - diffusers| transformer {error:.2e}")
    assert error <= ATOL
    pipe.unload_lora_weights()
