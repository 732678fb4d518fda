"""min_timestep / max_timestep as sd-scripts treats them (issue 52, item 3): its ``get_timesteps`` draws from
[min, max) and, with equal bounds, trains every sample at that one timestep; ``max_timestep = 0`` is 0, not the
default; bounds outside 0..1000 or crossed are one line. A real tiny run with equal bounds trains."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from test_hostile_inputs import ENV, config

from sd_scripts_compat.runtimes.noise_prediction import NoiseSettings, sample_noise_and_timesteps


@pytest.mark.parametrize(("low", "high", "allowed"), [(500, 500, {500}), (0, 0, {0}), (1000, 1000, {1000}),
                                                      (10, 12, {10, 11})])
def test_timesteps_within_the_bounds_and_equal_bounds_are_that_timestep(low, high, allowed):
    latents = torch.zeros(64, 4, 8, 8)
    _, timesteps = sample_noise_and_timesteps(latents, NoiseSettings(min_timestep=low, max_timestep=high),
                                              torch.Generator().manual_seed(0))
    assert timesteps.dtype == torch.long and set(timesteps.tolist()) == allowed


def run(tmp_path, **overrides):
    return subprocess.run([sys.executable, "-m", "sd_scripts_compat.train_network", "--config_file",
                           str(config(tmp_path, **overrides))], cwd=tmp_path, env=ENV, capture_output=True,
                          text=True, timeout=600)


def test_equal_bounds_train(tmp_path):
    done = run(tmp_path, min_timestep=500, max_timestep=500)
    assert done.returncode == 0 and (tmp_path / "out" / "lora.safetensors").is_file(), done.stderr[-2000:]


@pytest.mark.parametrize(("overrides", "said"), [({"max_timestep": 1001}, "max_timestep"),
                                                 ({"min_timestep": -1}, "min_timestep"),
                                                 ({"min_timestep": 600, "max_timestep": 500}, "above max_timestep")])
def test_bounds_sd_scripts_refuses_are_one_line(tmp_path, overrides, said):
    done = run(tmp_path, **overrides)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and said in lines[0], done.stderr[-2000:]
