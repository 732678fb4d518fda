"""channels_last for conv UNets (issue 27, point 4): the device rule, and the path it turns on, run for real.

Where the rule says yes (a CUDA card with tensor cores, fp16 / bf16) the engine stores the UNet's frozen 4-D weights
channels_last. No such card is here, so the rule is checked per device as a pure function, and the channels_last
path itself runs on this CPU by setting the rule's answer to yes in this process (the one thing faked: the device
that would answer yes): tiny-sd15 with LoCon conv adapters (which then convolve channels_last inputs) trains, saves
its state and LoRA, resumes from that state, and ends where the contiguous run from the same seed ends.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import toml

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("device", "dtype", "capability", "expected"), [
    ("cuda", "bfloat16", (8, 6), True),   # RTX 3090: tensor-core bf16 convolutions run NHWC
    ("cuda", "float16", (7, 5), True),    # RTX 2080
    ("cuda", "float32", (8, 9), False),   # fp32: no tensor-core kernel
    ("cuda", "float16", (6, 1), False),   # GTX 1080: no tensor cores
    ("cpu", "bfloat16", None, False),     # oneDNN: measured no faster on this CPU
    ("cpu", "float32", None, False),
])
def test_the_rule_per_device(device, dtype, capability, expected):
    import torch

    from sd_scripts_compat.training.devices import channels_last_pays

    assert channels_last_pays(device, getattr(torch, dtype), capability) is expected


def _train(tmp_path: Path, name: str, steps: int, resume: Path | None = None) -> Path:
    from sd_scripts_compat.train_network import main

    out = tmp_path / name
    config = tmp_path / f"{name}.toml"
    config.write_text(toml.dumps({
        "pretrained_model_name_or_path": "builtin:tiny-sd15", "train_data_dir": str(ROOT / "examples" / "dataset"),
        "output_dir": str(out), "output_name": "lora", "resolution": "64,64", "caption_extension": ".txt",
        "train_batch_size": 1, "max_train_steps": steps, "network_dim": 4, "network_alpha": 4,
        "network_args": ["conv_dim=4", "conv_alpha=4"], "learning_rate": 1e-3, "cache_latents": True,
        "max_data_loader_n_workers": 0, "seed": 3, "save_every_n_steps": 2, "save_state": True,
        "network_train_unet_only": True}))
    argv = ["--config_file", str(config), "--autotune_monitor_seconds", "0", "--autotune_events_dir", str(out)]
    assert main(argv + (["--resume", str(resume)] if resume else [])) == 0
    return out


def _deltas(out: Path) -> dict:
    """What each adapter adds to its weight, up @ down: the result, whatever the factors' own rounding path."""
    from safetensors.torch import load_file

    lora = load_file(str(out / "lora.safetensors"))
    names = {key.rsplit(".lora_", 1)[0] for key in lora if ".lora_up." in key}
    return {name: lora[f"{name}.lora_up.weight"].float().flatten(1)
            @ lora[f"{name}.lora_down.weight"].float().flatten(1) for name in names}


def test_channels_last_trains_saves_and_resumes_like_contiguous(tmp_path, monkeypatch):
    import torch

    from sd_scripts_compat.training import devices

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    plain = _train(tmp_path, "plain", 4)
    monkeypatch.setattr(devices, "channels_last_pays", lambda *_: True)  # the CUDA card this machine lacks
    nhwc = _train(tmp_path, "nhwc", 4)
    assert json.loads((nhwc / "done.json").read_text())["channels_last"] is True
    assert json.loads((plain / "done.json").read_text())["channels_last"] is False
    a, b = _deltas(plain), _deltas(nhwc)
    assert a.keys() == b.keys() and any("conv1" in name for name in b)  # LoCon: the 3x3 convs trained too
    # Tolerance: the largest learned delta is ~1e-3; AdamW turns a near-zero gradient (time_emb_proj's) into a
    # +-lr step whose sign follows rounding, so the deltas agree to 5e-5 absolute, not bit for bit.
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-2, atol=5e-5, msg=name)
    state = sorted(nhwc.glob("*-state"))[0]  # the state saved at step 2
    resumed = _train(tmp_path, "resumed", 4, resume=state)
    for name, delta in _deltas(resumed).items():
        torch.testing.assert_close(delta, b[name], rtol=1e-2, atol=5e-5, msg=name)
