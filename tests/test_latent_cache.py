"""Latent caching on the tiny VAE: memory == disk, disk reuse across runs, invalidation."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from PIL import Image

from sd_scripts_compat.caching.latent_cache import cache_latents, encode_images, latent_seed, offload
from sd_scripts_compat.dataset.train_dataset import build_dataset
from sd_scripts_compat.facts.dataset_spec import DatasetSpec, SubsetSpec
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import get_family
from sd_scripts_compat.models.build import build_modules


@pytest.fixture(scope="module")
def vae():
    return build_modules(get_family("tiny-sd15")).vae


def make_dataset(tmp_path, flip=False, random_crop=False):
    folder = tmp_path / "1_x"
    folder.mkdir(exist_ok=True)
    for i, size in enumerate([(64, 64), (96, 64), (64, 64)]):
        if not (folder / f"{i}.png").exists():
            Image.new("RGB", size, (40 * i, 90, 200 - 30 * i)).save(folder / f"{i}.png")
    spec = DatasetSpec(subsets=(SubsetSpec(str(folder), class_tokens="x", flip_aug=flip, random_crop=random_crop),),
                       resolution=(64, 64), batch_size=2, enable_bucket=True, min_bucket_reso=64,
                       max_bucket_reso=128, bucket_reso_steps=64)
    return build_dataset(spec, seed=0)


def test_memory_and_disk_caches_are_equal_and_used_in_batches(tmp_path, vae):
    memory = make_dataset(tmp_path, flip=True)
    stats = cache_latents(memory, vae, device="cpu", vae_batch_size=2)
    assert stats.encoded == 3 and len(memory.latents) == 3
    disk = make_dataset(tmp_path, flip=True)
    stats = cache_latents(disk, vae, device="cpu", vae_batch_size=1, to_disk=True)
    assert stats.encoded == 3 and stats.reused == 0
    for record in memory.records:
        assert disk.latent_files[record.index].is_file()
        assert disk.latent_files[record.index].parent == record.path.parent
        ids = [record.index]
        a = memory.collate(ids, epoch=0, step=0)
        b = disk.collate(ids, epoch=0, step=0)
        torch.testing.assert_close(a["latents"], b["latents"], rtol=1e-5, atol=1e-5)
        bw, bh = record.bucket
        assert a["latents"].shape == (1, 4, bh // 8, bw // 8)  # the tiny VAE downsamples 8x, like the real ones
        assert "images" not in a
    entry = memory.latents[0]
    assert entry.latents_flipped is not None and not torch.equal(entry.latents, entry.latents_flipped)
    # cached latents == the scaled posterior sample of the image the uncached path would load
    record = memory.records[0]
    batch = make_dataset(tmp_path).collate([0], epoch=0, step=0)
    with torch.no_grad():
        live = encode_images(vae, batch["images"], scaling_factor=vae.config.scaling_factor,
                             noise_seeds=[latent_seed(record)])
    torch.testing.assert_close(entry.latents, live[0], rtol=1e-5, atol=1e-5)


def test_disk_cache_reused_then_invalidated(tmp_path, vae):
    dataset = make_dataset(tmp_path)
    cache_latents(dataset, vae, to_disk=True)
    paths = [dataset.latent_files[r.index] for r in dataset.records]
    mtimes = [p.stat().st_mtime_ns for p in paths]
    again = make_dataset(tmp_path)
    stats = cache_latents(again, vae, to_disk=True)
    assert (stats.encoded, stats.reused) == (0, 3)
    assert [p.stat().st_mtime_ns for p in paths] == mtimes
    # touching an image without changing it keeps the cache (content hash)
    image0 = dataset.records[0].path
    os.utime(image0, ns=(image0.stat().st_atime_ns, image0.stat().st_mtime_ns + 10**9))
    assert cache_latents(make_dataset(tmp_path), vae, to_disk=True).encoded == 0
    # editing an image (same size in bytes or not) re-encodes just that one
    Image.new("RGB", (64, 64), (1, 2, 3)).save(image0)
    stats = cache_latents(make_dataset(tmp_path), vae, to_disk=True)
    assert (stats.encoded, stats.reused) == (1, 2)
    # another VAE (different weights) invalidates everything
    other = build_modules(get_family("tiny-sd15"), seed=1).vae
    assert cache_latents(make_dataset(tmp_path), other, to_disk=True).encoded == 3
    # flip_aug needs flipped latents: an unflipped cache is rebuilt
    assert cache_latents(make_dataset(tmp_path, flip=True), other, to_disk=True).encoded == 3


def test_random_crop_cannot_be_cached(tmp_path, vae):
    with pytest.raises(UserError, match="random_crop"):
        cache_latents(make_dataset(tmp_path, random_crop=True), vae)


def test_encode_images_is_batch_independent_and_offload(vae):
    images = torch.rand(3, 3, 64, 64) * 2 - 1
    together = encode_images(vae, images, scaling_factor=0.5, noise_seeds=[1, 2, 3])
    alone = encode_images(vae, images[1:2], scaling_factor=0.5, noise_seeds=[2])
    torch.testing.assert_close(together[1:2], alone, rtol=1e-4, atol=1e-5)
    offload(vae, "cpu")
    assert next(vae.parameters()).device.type == "cpu"


@pytest.mark.slow
def test_a_killed_runs_temp_files_beside_the_images_are_removed_by_the_next_run(tmp_path):
    """SIGKILL while a latent cache file is being written leaves its temp file beside the images; the next run
    removes it (its writer's PID is in its name and no longer runs) and trains."""
    import shutil
    import signal
    import subprocess
    import sys
    import time

    import toml

    from sd_scripts_compat.dataset.cache_entries import LATENT_CACHE_SUFFIX

    root = Path(__file__).resolve().parents[1]
    data = tmp_path / "data"
    shutil.copytree(root / "examples" / "dataset", data)
    config = tmp_path / "config.toml"
    config.write_text(toml.dumps({
        "pretrained_model_name_or_path": "builtin:tiny-sd15", "train_data_dir": str(data),
        "output_dir": str(tmp_path / "out"), "output_name": "lora", "resolution": "64,64",
        "caption_extension": ".txt", "max_train_steps": 2, "network_dim": 4, "cache_latents_to_disk": True,
        "max_data_loader_n_workers": 0}))
    command = [sys.executable, "-m", "sd_scripts_compat.train_network", "--config_file", str(config)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "SD_COMPAT_TEST_SAVE_PAUSE": f"*{LATENT_CACHE_SUFFIX}:60"}

    def temps() -> list[Path]:
        return list(data.rglob(".*.tmp"))

    child = subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not temps() and time.time() < deadline and child.poll() is None:
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=60)
    left = temps()
    assert left and all(str(child.pid) in p.name for p in left)
    env.pop("SD_COMPAT_TEST_SAVE_PAUSE")
    again = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert temps() == []


def _rewrite(path, **tensors):
    """Replace a cache file's tensors, keeping its metadata (a damaged file that still claims to be valid)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    save_file(tensors, str(path), metadata=metadata)


@pytest.mark.parametrize("damage, named", [
    (lambda e: {"latents": torch.zeros(4, 3, 3)}, "shape (4, 3, 3)"),
    (lambda e: {"latents": torch.full_like(e, float("nan"))}, "not finite"),
    (lambda e: {"latents": e.half()}, "dtype float16"),
])
def test_damaged_disk_entry_is_rebuilt_and_named_once(tmp_path, vae, damage, named):
    dataset = make_dataset(tmp_path)
    cache_latents(dataset, vae, to_disk=True)
    path = dataset.latent_files[0]
    good = dataset.collate([0], epoch=0, step=0)["latents"][0].clone()
    _rewrite(path, **damage(good))
    again = make_dataset(tmp_path)
    said = re.escape(f"rebuilding 1 damaged latent cache file(s) ({path.name}: ") + ".*" + re.escape(named)
    with pytest.warns(UserWarning, match=said):
        stats = cache_latents(again, vae, to_disk=True)
    assert (stats.encoded, stats.reused) == (1, 2)
    torch.testing.assert_close(again.collate([0], epoch=0, step=0)["latents"][0], good)


def test_entry_damaged_after_the_check_is_refused_by_the_data_path(tmp_path, vae):
    from sd_scripts_compat.dataset.cache_entries import DamagedEntry

    dataset = make_dataset(tmp_path)
    cache_latents(dataset, vae, to_disk=True)
    wide = dataset.records[1]
    path, shape = dataset.latent_files[wide.index], dataset.latent_shape(wide)
    assert shape == (4, 8, 8)
    _rewrite(path, latents=torch.zeros(4, 4, 8))  # another bucket's shape
    with pytest.raises(DamagedEntry, match=re.escape(f"{path}: the latent cache holds shape (4, 4, 8), not {shape}")
                       + ".*delete it and resume"):
        dataset.collate([wide.index], epoch=0, step=0)
    path.write_bytes(b"\x00" * 10)
    with pytest.raises(DamagedEntry, match="cannot be read"):
        dataset.collate([wide.index], epoch=0, step=0)


def test_two_vaes_on_one_dataset_use_their_own_files(tmp_path, vae):
    other = build_modules(get_family("tiny-sd15")).vae
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.mul_(0.5)
    first, second = make_dataset(tmp_path), make_dataset(tmp_path)
    cache_latents(first, vae, to_disk=True)
    cache_latents(second, other, to_disk=True)
    assert not set(first.latent_files.values()) & set(second.latent_files.values())
    before = {p: p.read_bytes() for p in first.latent_files.values()}
    again = make_dataset(tmp_path)
    assert cache_latents(again, vae, to_disk=True).encoded == 0  # the other VAE's run left ours alone
    assert {p: p.read_bytes() for p in first.latent_files.values()} == before
    assert len(list((tmp_path / "1_x").glob("*.latents.safetensors"))) == 6


def test_a_run_waits_for_the_one_building_an_entry(tmp_path, vae):
    """Another process holds the images (as a run caching them does): this one waits, then reuses what it wrote."""
    import subprocess
    import sys
    import threading
    import time

    dataset = make_dataset(tmp_path)
    cache_latents(dataset, vae, to_disk=True)
    built = {p: p.read_bytes() for p in dataset.latent_files.values()}
    for path in built:
        path.unlink()
    script = ("import fcntl, sys, pathlib, json, base64\n"
              "handles = [open(p, 'rb') for p in sorted(pathlib.Path(sys.argv[1]).glob('*.png'))]\n"
              "[fcntl.flock(h, fcntl.LOCK_EX) for h in handles]\n"
              "print('held', flush=True)\n"
              "for p, b in json.loads(sys.stdin.readline()).items():\n"
              "    pathlib.Path(p).write_bytes(base64.b64decode(b))\n")
    holder = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "1_x")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    result = {}
    waiting = make_dataset(tmp_path)
    thread = threading.Thread(target=lambda: result.update(stats=cache_latents(waiting, vae, to_disk=True)))
    thread.start()
    time.sleep(1.0)
    assert thread.is_alive() and not any(p.exists() for p in built)  # waiting, not encoding
    import base64
    import json
    holder.communicate(json.dumps({str(p): base64.b64encode(b).decode() for p, b in built.items()}) + "\n",
                       timeout=30)
    thread.join(timeout=60)
    assert (result["stats"].encoded, result["stats"].reused) == (0, 3)  # what the holder wrote, read finished
