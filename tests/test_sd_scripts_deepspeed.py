"""sd-scripts' DeepSpeed at ZeRO stage 2, which plans write for the families sd-scripts trains where the LoRA's
optimizer state is split across the cards (``autotune.planning.sharding``): the user's own sd-scripts, two CPU
processes under accelerate's launcher as the plan's command starts them, trains the same LoRA as stage 0 (plain
data parallel through DeepSpeed) from the same seed. Local only: it needs an sd-scripts checkout with DeepSpeed in
its venv (``DS_BUILD_OPS=0 pip install deepspeed``; not in sd-scripts' requirements), skipped otherwise with the
reason. sd-scripts' SD1.5 LoRA (train_network.py) is the run: every LoRA script of sd-scripts takes the same
DeepSpeed path (``NetworkTrainer.train``), and SD1.5 is the family whose full-size file is written here in 20 s."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import toml
import torch

from autotune.recovery.engine import free_port
from tests.fixtures.local import SD_SCRIPTS_SKIP, sd15_file, sd_scripts
from tests.test_host_ram import WRITE_SD15

ROOT = Path(__file__).resolve().parents[1]
DATASET = ROOT / "examples" / "dataset"


def _installed() -> tuple[Path, Path]:
    checkout, python = sd_scripts()
    if checkout is None or python is None:
        pytest.skip(SD_SCRIPTS_SKIP)
    found = subprocess.run([str(python), "-c", "import deepspeed"], capture_output=True, text=True)
    if found.returncode != 0:
        pytest.skip("local only: sd-scripts' Python has no DeepSpeed (DS_BUILD_OPS=0 pip install deepspeed)")
    return checkout, python


def _inputs(tmp: Path) -> tuple[Path, Path]:
    """The SD1.5 file ($LORA_AUTOTUNE_SD15_FILE, else written) and sd-scripts' CLIP tokenizer, offline."""
    from autotune.recovery.sd_scripts import tokenizer_cache
    from sd_scripts_compat.facts.families import get_family

    model = sd15_file()
    if model is None:
        model = tmp / "sd15.safetensors"
        subprocess.run([sys.executable, "-c", WRITE_SD15, str(model)], check=True, cwd=ROOT)
    family = get_family("sd15")
    pads = tuple(str(te.tokenizer.get("pad_token") or "<|endoftext|>") for te in family.text_encoders)
    return model, tokenizer_cache(tmp, family.single_file_layout, pads)


def _config(tmp: Path, model: Path) -> Path:
    subsets = [{"image_dir": str(folder), "num_repeats": 1} for folder in sorted(DATASET.iterdir())
               if folder.is_dir()]
    dataset = tmp / "dataset.toml"
    dataset.write_text(toml.dumps({"general": {"caption_extension": ".txt", "enable_bucket": False},
                                   "datasets": [{"resolution": 256, "batch_size": 1, "subsets": subsets}]}))
    config = tmp / "config.toml"
    config.write_text(toml.dumps({
        "pretrained_model_name_or_path": str(model), "dataset_config": str(dataset), "network_module": "networks.lora",
        "network_dim": 8, "network_alpha": 8, "network_train_unet_only": True, "optimizer_type": "AdamW",
        "learning_rate": 1e-4, "lr_scheduler": "constant", "max_train_steps": 4, "cache_latents": True,
        "mixed_precision": "no", "save_precision": "float", "sdpa": True, "seed": 42, "max_grad_norm": 1.0,
        "max_data_loader_n_workers": 0, "save_model_as": "safetensors", "output_name": "lora"}))
    return config


@pytest.mark.slow
def test_sd_scripts_deepspeed_stage_2_trains_the_same_lora(tmp_path: Path) -> None:
    """Stage 2 (the optimizer's state and the gradients split across the two processes) and stage 0, 4 steps
    each: the same LoRA, tensor for tensor (measured: bit-equal), and it trained (lora_up left zero)."""
    from safetensors.torch import load_file

    checkout, python = _installed()
    model, tokenizers = _inputs(tmp_path)
    config = _config(tmp_path, model)
    loras = {}
    for stage in (0, 2):
        out = tmp_path / f"stage{stage}"
        command = [str(python), "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                   "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                   "--main_process_port", str(free_port()), "train_network.py", "--config_file", str(config),
                   "--output_dir", str(out), "--tokenizer_cache_dir", str(tokenizers), "--deepspeed",
                   "--zero_stage", str(stage)]
        done = subprocess.run(command, cwd=checkout, capture_output=True, text=True, timeout=1500,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert done.returncode == 0, done.stderr[-3000:]
        loras[stage] = load_file(out / "lora.safetensors")
    assert list(loras[0]) == list(loras[2]) and len(loras[0]) == 576
    for key, tensor in loras[0].items():
        assert torch.equal(tensor, loras[2][key]), key
    assert max(t.abs().max().item() for k, t in loras[0].items() if "lora_up" in k) > 0
