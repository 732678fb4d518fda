"""Latent caching: encode each image once with the VAE, in memory or in a file beside the image.

A disk cache file is ``<image name>.<W>x<H>.latents.safetensors`` (named and read in ``dataset.cache_entries``)
and records what it was made from (image byte size + mtime + sha256, bucket, resize and crop, VAE
fingerprint, scaling factor, whether flipped latents are included), so it is reused across runs and
rebuilt when any of those change. When an image folder is not writable (a read-only mount, a shared
dataset), the files go under ``cache_dir`` instead (the run passes ``<output_dir>/.cache``; see
``dataset.cache_entries.cache_folder``), unless a valid cache already lies beside the image. sd-scripts only
checks the latent shape; it silently reuses latents of an edited image or of another VAE. Latents are
sampled from the VAE posterior (as kohya does), with a noise seed per image so memory and disk caches
hold identical values, and are stored already multiplied by the VAE's ``scaling_factor``.
"""

from __future__ import annotations

import errno
import gc
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sd_scripts_compat.atomic import atomic_path, remove_stale_temp_files
from sd_scripts_compat.contract import disk_full_guard
from sd_scripts_compat.dataset.buckets import resize_and_crop
from sd_scripts_compat.dataset.cache_entries import LatentEntry, folder_writable, latent_cache_path
from sd_scripts_compat.dataset.train_dataset import ImageRecord, TrainDataset, image_to_tensor, load_image_rgb, mix_seed
from sd_scripts_compat.errors import UserError

if TYPE_CHECKING:
    import torch

CACHE_FORMAT = "lora-autotune-latents/1"


@dataclass(frozen=True)
class CacheStats:
    encoded: int  # images run through the encoder in this call
    reused: int  # images whose disk cache was valid


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def module_fingerprint(module: Any) -> str:
    """A short id of a module's config and weights (per-tensor sums and absolute sums), so cached
    outputs of another VAE / text encoder are not reused. One pass over the weights."""
    import torch

    config = getattr(module, "config", {})
    config = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    # diffusers' bookkeeping keys are no part of the model, and "_use_default_values" is a list made from a set:
    # its order changes from process to process, which made every run miss the cache it wrote the run before
    config = {k: v for k, v in config.items() if not str(k).startswith("_")}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode("utf-8"))
    with torch.no_grad():
        for name, tensor in module.state_dict().items():
            values = tensor.detach().float()
            digest.update(f"{name}:{tuple(values.shape)}:{values.sum().item():.6e}:"
                          f"{values.abs().sum().item():.6e}".encode())
    return digest.hexdigest()[:16]


def vae_fingerprint(vae: Any) -> str:
    return module_fingerprint(vae)


def offload(module: Any, device: str = "cpu") -> None:
    """Move a module off the accelerator once it is no longer needed, and free the cached blocks."""
    import torch

    module.to(device)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def latent_factors(vae: Any) -> dict[str, float]:
    """The VAE's latent transform as :func:`encode_images` keywords: ``(z - shift_factor) * scaling_factor``
    (FLUX's 16-channel AE has a shift; the SD VAEs have none)."""
    return {"scaling_factor": float(vae.config.scaling_factor),
            "shift_factor": float(getattr(vae.config, "shift_factor", None) or 0.0)}


def encode_images(vae: Any, images: torch.Tensor, *, scaling_factor: float,
                  noise_seeds: list[int] | None = None, shift_factor: float = 0.0) -> torch.Tensor:
    """Images (B,3,H,W in [-1,1]) -> scaled latents (float32, on the VAE's device).

    The posterior sample is ``mean + std * noise``; with ``noise_seeds`` each image's noise comes
    from its own CPU generator, so the result does not depend on how images are batched. Used for
    caching and for the training loop's uncached path, so both see the same transform.
    """
    import torch

    parameter = next(vae.parameters())
    dist = vae.encode(images.to(device=parameter.device, dtype=parameter.dtype)).latent_dist
    mean, std = dist.mean.float(), dist.std.float()
    if noise_seeds is None:
        noise = torch.randn_like(mean)
    else:
        noise = torch.stack([torch.randn(mean.shape[1:], generator=torch.Generator().manual_seed(s))
                             for s in noise_seeds]).to(mean.device)
    sample = mean + std * noise
    return (sample - shift_factor) * scaling_factor if shift_factor else sample * scaling_factor


def _expected_metadata(dataset: TrainDataset, record: ImageRecord, vae_key: str, scaling_factor: float,
                       flip: bool, shift_factor: float = 0.0) -> dict[str, str]:
    geometry = record.center_geometry()
    shift = {"shift_factor": repr(float(shift_factor))} if shift_factor else {}  # FLUX's AE only
    return {**shift,
        "format": CACHE_FORMAT,
        "bucket": f"{geometry.bucket[0]}x{geometry.bucket[1]}",
        "resized_size": f"{geometry.resized_size[0]}x{geometry.resized_size[1]}",
        "crop_left_top": f"{geometry.crop_left},{geometry.crop_top}",
        "original_size": f"{geometry.original_size[0]}x{geometry.original_size[1]}",
        "vae": vae_key,
        "scaling_factor": repr(float(scaling_factor)),
        "flipped": str(bool(flip)),
    }


def _disk_cache_valid(path: Path, record: ImageRecord, expected: dict[str, str]) -> bool:
    from safetensors import safe_open

    if not path.is_file():
        return False
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
    except Exception:  # a truncated or foreign file is simply rebuilt
        return False
    if any(metadata.get(key) != value for key, value in expected.items()):
        return False
    stat = record.path.stat()
    if metadata.get("image_bytes") != str(stat.st_size):
        return False
    if metadata.get("image_mtime_ns") == str(stat.st_mtime_ns):
        return True
    return metadata.get("image_sha256") == file_sha256(record.path)  # touched or copied, same content


def _write_atomic(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)


def cache_latents(dataset: TrainDataset, vae: Any, *, device: Any = "cpu", dtype: Any = None, vae_batch_size: int = 1,
                  to_disk: bool = False, scaling_factor: float | None = None, vae_key: str | None = None,
                  is_main_process: bool = True, cache_dir: Path | None = None) -> CacheStats:
    """Encode every image of ``dataset`` once (kohya's ``cache_latents`` / ``cache_latents_to_disk``).

    Moves the VAE to ``device``/``dtype``; call :func:`offload` afterwards. Images are grouped by
    bucket into batches of ``vae_batch_size``. With ``flip_aug`` the mirrored image is encoded too
    (as sd-scripts does). ``random_crop`` cannot be cached (the crop would be frozen): a UserError,
    as in sd-scripts. With ``to_disk`` and ``is_main_process=False`` nothing is encoded; the files
    written by the main process are only registered (the caller waits for it first). ``cache_dir``: where
    the files of images in a folder we cannot write to go (None: such a folder is a one-line UserError).
    """
    import torch

    for subset in dataset.subsets:
        if subset.random_crop:
            raise UserError(f"random_crop (subset {subset.image_dir}) cannot be used with cache_latents; "
                            "turn one of them off")
    factor = float(scaling_factor if scaling_factor is not None else vae.config.scaling_factor)
    shift = latent_factors(vae)["shift_factor"]
    key = vae_key if vae_key is not None else vae_fingerprint(vae)

    pending: list[ImageRecord] = []
    reused = 0
    if to_disk and is_main_process:  # what a killed run left beside the images goes first
        for folder in {latent_cache_path(record, where).parent for record in dataset.records
                       for where in (None, cache_dir)}:
            remove_stale_temp_files(folder)
    for record in dataset.records:
        flip = dataset.subset_of(record).flip_aug
        if to_disk:
            expected = _expected_metadata(dataset, record, key, factor, flip, shift)
            path = latent_cache_path(record)
            if cache_dir is not None and not folder_writable(path.parent) \
                    and not _disk_cache_valid(path, record, expected):
                path = latent_cache_path(record, cache_dir)  # the same check on every process: they agree
            dataset.latent_files[record.index] = path
            dataset.latents.pop(record.index, None)
            if not is_main_process:
                continue
            if _disk_cache_valid(path, record, expected):
                reused += 1
                continue
        pending.append(record)
    if to_disk and not is_main_process:
        return CacheStats(0, 0)

    if pending:
        vae.to(device=device) if dtype is None else vae.to(device=device, dtype=dtype)
    pending.sort(key=lambda r: (r.bucket[0] * r.bucket[1], r.bucket))
    batches: list[list[ImageRecord]] = []
    for record in pending:
        if batches and batches[-1][0].bucket == record.bucket and len(batches[-1]) < max(1, vae_batch_size):
            batches[-1].append(record)
        else:
            batches.append([record])

    with torch.no_grad():
        for batch in batches:
            from PIL import ImageOps

            geometries = [r.center_geometry() for r in batch]
            images = [resize_and_crop(load_image_rgb(r.path), g) for r, g in zip(batch, geometries)]
            seeds = [mix_seed("latent", str(r.path), r.bucket) for r in batch]
            latents = encode_images(vae, torch.stack([image_to_tensor(i) for i in images]),
                                    scaling_factor=factor, shift_factor=shift, noise_seeds=seeds).cpu()
            flips = [dataset.subset_of(r).flip_aug for r in batch]
            flipped = None
            if any(flips):
                mirrored = torch.stack([image_to_tensor(ImageOps.mirror(i)) for i in images])
                flipped = encode_images(vae, mirrored, scaling_factor=factor, shift_factor=shift,
                                        noise_seeds=[mix_seed("latent-flip", s) for s in seeds]).cpu()
            for i, record in enumerate(batch):
                mirrored_latents = flipped[i].clone() if flips[i] and flipped is not None else None
                entry = LatentEntry(latents[i].clone(), mirrored_latents)
                if to_disk:
                    _save_entry(dataset, record, entry, key, factor, flips[i], dataset.latent_files[record.index],
                                shift)
                else:
                    dataset.latents[record.index] = entry
    return CacheStats(encoded=len(pending), reused=reused)


def _save_entry(dataset: TrainDataset, record: ImageRecord, entry: LatentEntry, vae_key: str, factor: float,
                flip: bool, path: Path, shift: float = 0.0) -> None:
    stat = record.path.stat()
    metadata = _expected_metadata(dataset, record, vae_key, factor, flip, shift)
    metadata.update(image_bytes=str(stat.st_size), image_mtime_ns=str(stat.st_mtime_ns),
                    image_sha256=file_sha256(record.path))
    tensors = {"latents": entry.latents}
    if entry.latents_flipped is not None:
        tensors["latents_flipped"] = entry.latents_flipped
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with disk_full_guard(path.parent, sum(t.numel() * t.element_size() for t in tensors.values()),
                             f"the latent cache of {record.path.name}"):
            _write_atomic(path, tensors, metadata)
    except OSError as error:
        if error.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        raise UserError(f"{path.parent}: cannot write the latent cache there ({error.strerror}); "
                        "use cache_latents instead of cache_latents_to_disk") from None
