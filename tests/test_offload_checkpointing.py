"""cpu_offload_checkpointing (sd-scripts' option for its transformer scripts): the config rules as sd-scripts has
them, the engine trains with it, and the memory / speed models move the checkpointed block inputs to the host.

What this CPU cannot show: the host copies themselves (on a CPU the host is the device, so the checkpoint function
takes the plain path); ``bench/gpu_validate_dit.py`` measures the offloaded case on a CUDA card."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from fixtures.engine_runs import run_engine
from test_flux_engine import base_config as flux_config

from autotune.estimate.dit_memory import DitMemoryInputs, offloaded_checkpoint_bytes, predict_dit_memory
from autotune.estimate.dit_speed import offload_seconds
from sd_scripts_compat.network.lora_file import read_lora_file


def test_memory_and_speed_models_move_the_block_inputs_to_the_host():
    from autotune.estimate.dit_memory import dit_family_calibration
    from autotune.hardware.gpu_catalog import lookup_gpu

    base = DitMemoryInputs(family="flux-dev", resolution=1024, batch_size=2, gradient_checkpointing=True)
    offload = replace(base, cpu_offload_checkpointing=True)
    kept, moved = predict_dit_memory(base), predict_dit_memory(offload)
    stored = offloaded_checkpoint_bytes(dit_family_calibration("flux-dev"), offload)
    # FLUX.1: 57 blocks, the 56 not in flight: 2 bytes x 3072 x (4096 image + 512 text tokens) x batch 2
    assert stored == 2 * 56 * 3072 * 4608 * 2
    assert kept.components["activations"] - moved.components["activations"] == stored
    assert moved.host_ram_bytes - kept.host_ram_bytes == stored
    assert moved.components["activations"] > 0
    card = lookup_gpu("RTX 4090")
    assert offload_seconds(offload, card) > 0 == offload_seconds(base, card)
    no_gc = replace(base, gradient_checkpointing=False, cpu_offload_checkpointing=True)
    assert offloaded_checkpoint_bytes(dit_family_calibration("flux-dev"), no_gc) == 0


@pytest.mark.parametrize(("changes", "said"), [
    ({"cpu_offload_checkpointing": True, "blocks_to_swap": 2}, "blocks_to_swap cannot go with it"),
])
def test_offload_with_block_swap_is_one_line(tmp_path, changes, said):
    result = run_engine("flux_train_network", tmp_path, flux_config(tmp_path, **changes), check=False)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert said in result.stderr and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_engine_trains_with_offload_as_with_checkpointing(tmp_path):
    """On a CPU the offload is the plain checkpoint: the LoRA equals the checkpointed run's; the option also turns
    checkpointing on by itself (said once), as sd-scripts does."""
    checkpointed = flux_config(tmp_path, gradient_checkpointing=True, max_train_steps=2)
    run_engine("flux_train_network", tmp_path, checkpointed)
    offloaded = dict(checkpointed, gradient_checkpointing=False, cpu_offload_checkpointing=True,
                     output_dir=str(tmp_path / "offloaded"))
    result = run_engine("flux_train_network", tmp_path, offloaded, name="offloaded.toml")
    assert "cpu_offload_checkpointing turns gradient_checkpointing on" in result.stderr
    want = read_lora_file(tmp_path / "out" / f"{checkpointed['output_name']}.safetensors")[0]
    got = read_lora_file(tmp_path / "offloaded" / f"{checkpointed['output_name']}.safetensors")[0]
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
