"""No host synchronisation per training step (issue 27): the loop reads a value back from the device only when it
reports progress (the first step, then every few seconds), never once per step.

The engine trains builtin:tiny-sd15 in this process under torch's profiler, once for 3 steps and once for 9, with
progress reports made rare; every call that makes the host wait for the device (``aten::_local_scalar_dense``, what
``Tensor.item``, ``bool(tensor)`` and data-dependent shapes dispatch to) is counted. Six more steps must add none.
Left out: the reads inside the fused AdamW kernel (``aten::_fused_adamw_``). On the CPU its kernel reads its own
step counter, a host tensor, 120 times per step here; there is no device to wait for, and CUDA's fused kernel reads
that counter on the device.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import toml

ROOT = Path(__file__).resolve().parents[1]
SYNC = "aten::_local_scalar_dense"
INSIDE_FUSED_OPTIMIZER = ("aten::_fused_adamw_", "aten::_fused_adam_")


def synchronising_calls(tmp_path: Path, steps: int) -> int:
    import torch

    from sd_scripts_compat.train_network import main

    config = tmp_path / f"config-{steps}.toml"
    config.write_text(toml.dumps({
        "pretrained_model_name_or_path": "builtin:tiny-sd15", "train_data_dir": str(ROOT / "examples" / "dataset"),
        "output_dir": str(tmp_path / f"out-{steps}"), "output_name": "lora", "resolution": "64,64",
        "caption_extension": ".txt", "train_batch_size": 1, "max_train_steps": steps, "network_dim": 4,
        "learning_rate": 1e-4, "max_grad_norm": 1.0, "cache_latents": True, "max_data_loader_n_workers": 0,
        "seed": 1}))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        assert main(["--config_file", str(config), "--autotune_monitor_seconds", "0"]) == 0
    return sum(1 for event in profile.events() if event.name == SYNC and not _inside(event, INSIDE_FUSED_OPTIMIZER))


def _inside(event: object, names: tuple[str, ...]) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in names:
            return True
        parent = parent.cpu_parent
    return False


def test_more_steps_add_no_synchronising_call(tmp_path, monkeypatch):
    from sd_scripts_compat.training import recipe

    monkeypatch.setattr(recipe, "PROGRESS_EVERY_SECONDS", 1e9)  # the first and the last step report, no other
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    few, more = synchronising_calls(tmp_path, 3), synchronising_calls(tmp_path, 9)
    assert more == few, f"{more - few} synchronising calls in 6 more steps (3 steps: {few}, 9 steps: {more})"


pytestmark = pytest.mark.slow
