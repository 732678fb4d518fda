"""Two runs on one dataset at the same time (issue 22): real engine processes on tiny models, disk caches on.

- two families (tiny-sdxl and tiny-flux: other VAEs, other latent shapes) train side by side on one folder, and
  again: each has its own cache files (the key in the name), neither reads or rewrites the other's, and the
  second time both reuse everything they wrote;
- two runs of one model share the entries: between them each image is encoded once (the other waits for it
  and reads it finished).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import toml
from PIL import Image
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
IMAGES = 4


def make_dataset(root: Path) -> Path:
    folder = root / "data" / "1_toy"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(IMAGES):
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(f"toy, picture {i}", encoding="utf-8")
    return folder


def start(tmp_path: Path, data: Path, name: str, model: str) -> subprocess.Popen:
    values = {"pretrained_model_name_or_path": model, "train_data_dir": str(data.parent),
              "output_dir": str(tmp_path / name), "output_name": name, "resolution": "64,64",
              "caption_extension": ".txt", "train_batch_size": 2, "max_train_steps": 2, "network_dim": 4,
              "learning_rate": 1e-3, "seed": 1, "max_data_loader_n_workers": 0, "cache_latents_to_disk": True,
              "network_train_unet_only": True}
    script = "sd_scripts_compat.train_network"
    if "sdxl" in model:
        script = "sd_scripts_compat.sdxl_train_network"
        values.update(cache_text_encoder_outputs_to_disk=True)
    if "flux" in model:
        script = "sd_scripts_compat.flux_train_network"
        values.update(t5xxl_max_token_length=16, guidance_scale=1.0, cache_text_encoder_outputs_to_disk=True)
    config = tmp_path / f"{name}.toml"
    config.write_text(toml.dumps(values), encoding="utf-8")
    return subprocess.Popen([sys.executable, "-m", script, "--config_file", str(config)], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(runs: dict[str, subprocess.Popen]) -> dict[str, tuple[int, int]]:
    """Wait for each run; its (encoded, reused) latent counts from its own report line."""
    counts = {}
    for name, run in runs.items():
        stdout, stderr = run.communicate(timeout=900)
        assert run.returncode == 0, f"{name}: {stderr[-3000:]}"
        found = re.search(r"latent cache: (\d+) encoded, (\d+) reused from disk", stdout)
        assert found, stdout[-2000:]
        counts[name] = (int(found[1]), int(found[2]))
    return counts


def latent_files(folder: Path) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for path in folder.glob("*.latents.safetensors"):
        with safe_open(str(path), framework="pt") as handle:
            shapes[path.name] = tuple(handle.get_slice("latents").get_shape())
    return shapes


@pytest.mark.slow
def test_two_families_train_side_by_side_on_one_dataset_twice_without_touching_each_others_cache(tmp_path):
    data = make_dataset(tmp_path)
    first = finish({"sdxl": start(tmp_path, data, "sdxl", "builtin:tiny-sdxl"),
                    "flux": start(tmp_path, data, "flux", "builtin:tiny-flux")})
    assert first == {"sdxl": (IMAGES, 0), "flux": (IMAGES, 0)}
    files = latent_files(data)
    assert len(files) == 2 * IMAGES  # one per image and model: the model's key is in the name
    assert sorted(shape[0] for shape in files.values()) == [4] * IMAGES + [16] * IMAGES  # SDXL's VAE, FLUX's AE
    written = {path.name: path.stat().st_mtime_ns for path in data.glob("*.safetensors")}
    assert len(written) == 2 * IMAGES + 2 * IMAGES  # text-encoder outputs: also one file per image and model

    again = finish({"sdxl": start(tmp_path, data, "sdxl2", "builtin:tiny-sdxl"),
                    "flux": start(tmp_path, data, "flux2", "builtin:tiny-flux")})
    assert again == {"sdxl": (0, IMAGES), "flux": (0, IMAGES)}
    assert {path.name: path.stat().st_mtime_ns for path in data.glob("*.safetensors")} == written  # none rewritten
    assert not [p for p in data.iterdir() if p.name.startswith(".")]  # no temp or lock file in the dataset


@pytest.mark.slow
def test_two_runs_of_one_model_encode_each_image_once_between_them(tmp_path):
    data = make_dataset(tmp_path)
    counts = finish({"a": start(tmp_path, data, "a", "builtin:tiny-sd15"),
                     "b": start(tmp_path, data, "b", "builtin:tiny-sd15")})
    assert counts["a"][0] + counts["b"][0] == IMAGES, counts  # the other one waited and read it
    assert counts["a"][1] + counts["b"][1] == IMAGES, counts
    assert len(latent_files(data)) == IMAGES
