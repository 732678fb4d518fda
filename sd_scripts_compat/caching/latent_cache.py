"""Latent caching: encode each image once with the VAE, in memory or in a file beside the image.

A disk cache file is ``<image name>.<W>x<H>.<key>.latents.safetensors`` (named and read in
``dataset.cache_entries``; the key names the VAE and settings, so other models' runs use other files)
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
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sd_scripts_compat.caching.build_lock import images_locked
from sd_scripts_compat.dataset.buckets import resize_and_crop
from sd_scripts_compat.dataset.cache_entries import (
    LatentEntry,
    entry_key,
    folder_writable,
    latent_cache_path,
    latent_problem,
    load_latent_file,
)
from sd_scripts_compat.dataset.train_dataset import ImageRecord, TrainDataset, image_to_tensor, load_image_rgb, mix_seed
from sd_scripts_compat.facts.atomic import atomic_path, remove_stale_temp_files
from sd_scripts_compat.facts.contract import disk_full_guard
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.hashes import file_sha256

if TYPE_CHECKING:
    import torch
    from diffusers import AutoencoderKL

CACHE_FORMAT = "lora-autotune-latents/1"


@dataclass(frozen=True)
class CacheStats:
    encoded: int  # images run through the encoder in this call
    reused: int  # images whose disk cache was valid


def module_fingerprint(module: torch.nn.Module) -> str:
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


def vae_fingerprint(vae: AutoencoderKL) -> str:
    return module_fingerprint(vae)


def offload(module: torch.nn.Module, device: str = "cpu") -> None:
    """Move a module off the accelerator once it is no longer needed, and free the cached blocks."""
    import torch

    module.to(device)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def latent_factors(vae: AutoencoderKL) -> dict[str, float]:
    """The VAE's latent transform as :func:`encode_images` keywords: ``(z - shift_factor) * scaling_factor``
    (FLUX's 16-channel AE has a shift; the SD VAEs have none)."""
    return {"scaling_factor": float(vae.config.scaling_factor),
            "shift_factor": float(getattr(vae.config, "shift_factor", None) or 0.0)}


def encode_images(vae: AutoencoderKL, images: torch.Tensor, *, scaling_factor: float,
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
                       flip: bool, shift_factor: float = 0.0, vae_dtype: str = "") -> dict[str, str]:
    geometry = record.center_geometry()
    shift = {"shift_factor": repr(float(shift_factor))} if shift_factor else {}  # FLUX's AE only
    dtype = {"vae_dtype": vae_dtype} if vae_dtype else {}
    return {**shift, **dtype,
        "format": CACHE_FORMAT,
        "bucket": f"{geometry.bucket[0]}x{geometry.bucket[1]}",
        "resized_size": f"{geometry.resized_size[0]}x{geometry.resized_size[1]}",
        "crop_left_top": f"{geometry.crop_left},{geometry.crop_top}",
        "original_size": f"{geometry.original_size[0]}x{geometry.original_size[1]}",
        "vae": vae_key,
        "scaling_factor": repr(float(scaling_factor)),
        "flipped": str(bool(flip)),
    }


def _disk_entry_problem(path: Path, record: ImageRecord, expected: dict[str, str], shape: tuple[int, ...] | None,
                        flip: bool) -> str | None:
    """None: ``path`` holds a valid entry for ``record``; "": absent or made from another image (rebuilt quietly);
    otherwise what is wrong with it (rebuilt and named)."""
    from safetensors import safe_open

    if not path.is_file():
        return ""
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
    except Exception:  # noqa: BLE001 - a truncated or foreign file
        return "unreadable"
    if any(metadata.get(key) != value for key, value in expected.items()):
        return "made with other settings"  # only a hash collision of the key, or a file renamed by hand
    stat = record.path.stat()
    same_image = metadata.get("image_bytes") == str(stat.st_size) and (
        metadata.get("image_mtime_ns") == str(stat.st_mtime_ns)
        or metadata.get("image_sha256") == file_sha256(record.path))  # touched or copied, same content
    if not same_image:
        return ""
    try:
        entry = load_latent_file(path)
    except Exception:  # noqa: BLE001
        return "unreadable"
    return latent_problem(entry, shape, flip)


def _write_atomic(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)


def latent_geometry(vae: AutoencoderKL) -> tuple[int, int]:
    """(latent channels, spatial downscale) of a diffusers VAE: 4 and 8 for SD, 16 and 8 for FLUX's AE."""
    config = vae.config
    return int(config.latent_channels), 2 ** (len(config.block_out_channels) - 1)


def cache_latents(dataset: TrainDataset, vae: AutoencoderKL, *, device: str | torch.device = "cpu",
                  dtype: torch.dtype | None = None, vae_batch_size: int = 1,
                  to_disk: bool = False, scaling_factor: float | None = None, vae_key: str | None = None,
                  is_main_process: bool = True, cache_dir: Path | None = None,
                  progress: Callable[[int], None] | None = None) -> CacheStats:
    """Encode every image of ``dataset`` once (kohya's ``cache_latents`` / ``cache_latents_to_disk``).

    Moves the VAE to ``device``/``dtype``; call :func:`offload` afterwards. Images are grouped by
    bucket into batches of ``vae_batch_size``. With ``flip_aug`` the mirrored image is encoded too
    (as sd-scripts does). ``random_crop`` cannot be cached (the crop would be frozen): a UserError,
    as in sd-scripts. With ``to_disk`` and ``is_main_process=False`` nothing is encoded; the files
    written by the main process are only registered (the caller waits for it first). ``cache_dir``: where
    the files of images in a folder we cannot write to go (None: such a folder is a one-line UserError).
    A disk entry that is damaged (unreadable, wrong shape or dtype, not finite) is rebuilt and named in one
    warning; latents the VAE makes non-finite (a float16 VAE overflowing) are a UserError. ``progress(n)`` is
    told each batch's images as they are done.
    """
    for subset in dataset.subsets:
        if subset.random_crop:
            raise UserError(f"random_crop (subset {subset.image_dir}) cannot be used with cache_latents; "
                            "turn one of them off")
    factor = float(scaling_factor if scaling_factor is not None else vae.config.scaling_factor)
    shift = latent_factors(vae)["shift_factor"]
    key = vae_key if vae_key is not None else vae_fingerprint(vae)
    dataset.latent_geometry = latent_geometry(vae)
    vae_dtype = str(dtype if dtype is not None else next(vae.parameters()).dtype).removeprefix("torch.")

    def expected(record: ImageRecord) -> dict[str, str]:
        return _expected_metadata(dataset, record, key, factor, dataset.subset_of(record).flip_aug, shift, vae_dtype)

    def problem(record: ImageRecord) -> str | None:
        return _disk_entry_problem(dataset.latent_files[record.index], record, expected(record),
                                   dataset.latent_shape(record), dataset.subset_of(record).flip_aug)

    if to_disk:
        _place_files(dataset, cache_dir, expected, problem, is_main_process)
        if not is_main_process:
            return CacheStats(0, 0)
    problems = {r.index: problem(r) for r in dataset.records} if to_disk else {}
    pending = [r for r in dataset.records if not to_disk or problems[r.index] is not None]
    _name_damaged(dataset, [(r, problems[r.index]) for r in pending if problems.get(r.index)])

    if pending:
        vae.to(device=device) if dtype is None else vae.to(device=device, dtype=dtype)
    encoded = 0
    for batch in _batches(pending, vae_batch_size):
        with images_locked(r.path for r in batch if to_disk):
            todo = [r for r in batch if not to_disk or problem(r) is not None]  # another run may have built it
            if todo:
                _encode_batch(dataset, vae, todo, factor, shift, to_disk, expected)
            encoded += len(todo)
        if progress is not None:
            progress(len(batch))
    return CacheStats(encoded=encoded, reused=len(dataset.records) - encoded)


def _place_files(dataset: TrainDataset, cache_dir: Path | None, expected: Callable[[ImageRecord], dict[str, str]],
                 problem: Callable[[ImageRecord], str | None], is_main_process: bool) -> None:
    """Register each record's disk file (beside the image, or under ``cache_dir`` when the image's folder is
    not writable and holds no valid entry); the main process first removes what a killed run left."""
    if is_main_process:
        for folder in {latent_cache_path(record, "x", where).parent for record in dataset.records
                       for where in (None, cache_dir)}:
            remove_stale_temp_files(folder)
    for record in dataset.records:
        key = entry_key(expected(record))
        dataset.latent_files[record.index] = latent_cache_path(record, key)
        dataset.latents.pop(record.index, None)
        if cache_dir is not None and not folder_writable(record.path.parent) and problem(record) is not None:
            dataset.latent_files[record.index] = latent_cache_path(record, key, cache_dir)  # every process agrees


def _name_damaged(dataset: TrainDataset, damaged: list[tuple[ImageRecord, str | None]]) -> None:
    if not damaged:
        return
    named = "; ".join(f"{dataset.latent_files[r.index].name}: {why}" for r, why in damaged[:3])
    more = f" and {len(damaged) - 3} more" if len(damaged) > 3 else ""
    warnings.warn(f"rebuilding {len(damaged)} damaged latent cache file(s) ({named}{more})", stacklevel=3)


def _batches(records: list[ImageRecord], size: int) -> list[list[ImageRecord]]:
    """Records of one bucket together, ``size`` at a time, smallest buckets first."""
    batches: list[list[ImageRecord]] = []
    for record in sorted(records, key=lambda r: (r.bucket[0] * r.bucket[1], r.bucket)):
        if batches and batches[-1][0].bucket == record.bucket and len(batches[-1]) < max(1, size):
            batches[-1].append(record)
        else:
            batches.append([record])
    return batches


def latent_seed(record: ImageRecord) -> int:
    """The seed of the VAE's sampling noise for one image: from its folder and file name and bucket, so the same
    latents come out wherever the dataset lies (an absolute path made a run's result depend on the checkout)."""
    return mix_seed("latent", f"{record.path.parent.name}/{record.path.name}", record.bucket)


def _encode_batch(dataset: TrainDataset, vae: AutoencoderKL, batch: list[ImageRecord], factor: float, shift: float,
                  to_disk: bool, expected: Callable[[ImageRecord], dict[str, str]]) -> None:
    import torch
    from PIL import ImageOps

    with torch.no_grad():
        geometries = [r.center_geometry() for r in batch]
        images = [resize_and_crop(load_image_rgb(r.path), g) for r, g in zip(batch, geometries)]
        seeds = [latent_seed(r) for r in batch]
        latents = encode_images(vae, torch.stack([image_to_tensor(i) for i in images]),
                                scaling_factor=factor, shift_factor=shift, noise_seeds=seeds).cpu()
        flips = [dataset.subset_of(r).flip_aug for r in batch]
        flipped = None
        if any(flips):
            mirrored = torch.stack([image_to_tensor(ImageOps.mirror(i)) for i in images])
            flipped = encode_images(vae, mirrored, scaling_factor=factor, shift_factor=shift,
                                    noise_seeds=[mix_seed("latent-flip", s) for s in seeds]).cpu()
    for i, record in enumerate(batch):
        entry = LatentEntry(latents[i].clone(), flipped[i].clone() if flips[i] and flipped is not None else None)
        if latent_problem(entry, None, False):
            dtype = str(next(vae.parameters()).dtype).removeprefix("torch.")
            raise UserError(f"{record.path}: the VAE gave latents that are not finite in {dtype}; "
                            "add no_half_vae = true (or a VAE that is stable in half precision)")
        if to_disk:
            _save_entry(record, entry, expected(record), dataset.latent_files[record.index])
        else:
            dataset.latents[record.index] = entry


def _save_entry(record: ImageRecord, entry: LatentEntry, metadata: dict[str, str], path: Path) -> None:
    stat = record.path.stat()
    metadata = {**metadata, "image_bytes": str(stat.st_size), "image_mtime_ns": str(stat.st_mtime_ns),
                "image_sha256": file_sha256(record.path)}
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
