"""DreamBooth-style datasets: scan, repeats, regularization balancing, buckets, epoch order, batches.

The epoch order is a pure function of (seed, epoch), and every random choice inside a batch
(caption shuffling/dropout, flips, random crops) is seeded from (seed, epoch, step, position), so a
resumed run rebuilds the exact batch of any step, whatever the number of DataLoader workers.

Test hook: ``SD_COMPAT_TEST_DECODE_DELAY=SECONDS`` makes every image decode wait that long (a starved loader
for the bottleneck report's tests, as large PNGs on a slow disk would be). Read at each decode; unset in use.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from sd_scripts_compat.dataset.buckets import (
    BucketAssignment,
    BucketConfig,
    CropGeometry,
    Size,
    crop_geometry,
    resize_and_crop,
)
from sd_scripts_compat.dataset.cache_entries import LatentEntry, TextEntry, read_latent_file, read_text_file
from sd_scripts_compat.dataset.captions import base_caption, process_caption, tag_frequency
from sd_scripts_compat.facts.dataset_scan import IMAGE_EXTENSIONS, FolderListing, caption_coverage
from sd_scripts_compat.facts.dataset_spec import DatasetSpec, SubsetSpec
from sd_scripts_compat.facts.errors import UserError

if TYPE_CHECKING:
    import PIL.Image
    import torch
    import torch.utils.data

DECODE_DELAY_ENV = "SD_COMPAT_TEST_DECODE_DELAY"


def mix_seed(*parts: object) -> int:
    """A stable 63-bit seed from any parts (Python's ``hash`` is salted per process, so not that)."""
    digest = hashlib.blake2b(repr(parts).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class ImageRecord:
    """One image of the dataset, after scanning and bucketing (repeats are counted, not copied)."""

    index: int
    path: Path
    caption: str  # before per-step processing (prefix/suffix, shuffle, dropout happen in collate)
    subset_index: int
    is_reg: bool
    num_repeats: int
    image_size: Size
    assignment: BucketAssignment

    @property
    def bucket(self) -> Size:
        return self.assignment.bucket

    def center_geometry(self) -> CropGeometry:
        return crop_geometry(self.image_size, self.assignment)


@dataclass(frozen=True)
class BatchKey:
    """What a sampler hands the dataset: enough to rebuild one step's batch exactly."""

    epoch: int
    step: int  # index of the batch within the epoch
    items: tuple[int, ...]  # ImageRecord indices


def _scan_dir(image_dir: Path) -> tuple[list[Path], FolderListing]:
    if not image_dir.is_dir():
        raise UserError(f"image_dir {image_dir}: not a directory; fix the path in train_data_dir / dataset_config")
    listing = FolderListing.read(image_dir)
    paths = listing.images()
    if not paths:
        raise UserError(f"image_dir {image_dir}: no images ({', '.join(IMAGE_EXTENSIONS)}); add images or remove "
                        "the subset")
    return paths, listing


def _warn_about_captions(subset: SubsetSpec, paths: list[Path], captions: list[str], empty: list[Path],
                         listing: FolderListing) -> None:
    """Say when captions will not train as the user probably meant: caption files under another extension
    than ``caption_extension`` (never read), blank caption files, images with no caption at all."""
    coverage = caption_coverage(paths, subset.caption_extension, [listing])
    if coverage.problem():
        warnings.warn(f"{subset.image_dir}: {coverage.line()}; {coverage.problem()}", stacklevel=3)
    blank = [path for path, caption in zip(paths, captions) if not caption.strip()
             and path.with_name(path.stem + subset.caption_extension).is_file()]
    if blank:
        warnings.warn(f"{len(blank)} caption file(s) in {subset.image_dir} are blank (only whitespace; first: "
                      f"{blank[0].name}); those images train with an empty caption", stacklevel=3)
    if empty:
        warnings.warn(f"{len(empty)} images in {subset.image_dir} have neither a {subset.caption_extension} "
                      f"caption nor class tokens (first: {empty[0].name}); they train with an empty caption",
                      stacklevel=3)


def read_image_size(path: Path) -> Size:
    """(width, height) from the header, after ``verify()`` so a broken file fails now, not mid-run.

    ``verify()`` does not decode JPEG data, so a JPEG without its end marker is decoded once here: a truncated
    file is a one-line error now instead of a crash while caching latents or in a DataLoader worker. A file over
    Pillow's decompression-bomb limit is one too; between its warning and its error limits Pillow's warning is
    silenced (sd-scripts loads such files; the doctor reports them).
    """
    from PIL import Image, UnidentifiedImageError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            with Image.open(path) as image:
                size, fmt = image.size, image.format
                image.verify()
            if fmt == "JPEG" and not _jpeg_has_end_marker(path):
                with Image.open(path) as image:
                    image.load()
        except Image.DecompressionBombError:
            raise UserError(_bomb_message(path)) from None
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
            what = "the file is truncated" if "truncated" in str(exc).lower() else exc.__class__.__name__
            raise UserError(f"{path}: cannot read image ({what}); replace or delete the file") from None
    if size[0] <= 0 or size[1] <= 0:
        raise UserError(f"{path}: image has size {size}; replace or delete the file")
    return size


def _jpeg_has_end_marker(path: Path) -> bool:
    """A whole JPEG ends with EOI (FF D9), perhaps followed by a little padding; a cut-off one does not."""
    with path.open("rb") as handle:
        handle.seek(0, 2)
        handle.seek(max(0, handle.tell() - 4096))
        return b"\xff\xd9" in handle.read()


def _bomb_message(path: Path) -> str:
    from PIL import Image

    limit = 2 * (Image.MAX_IMAGE_PIXELS or 0)
    return (f"{path}: the image has more than {limit / 1e6:.0f} MP (Pillow's decompression-bomb limit), so it is "
            "not decoded; downscale it (a long side of 2048 px is plenty for any bucket) or delete it")


# 16-bit (and 32-bit) greyscale: Pillow's convert("RGB") clips them to 255 instead of scaling, which turns a
# 16-bit picture nearly white; they are scaled to 8 bits first (a 16-bit PNG opens as I;16 or, older Pillow, I).
HIGH_BIT_GREY_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")


def to_rgb(image: PIL.Image.Image) -> PIL.Image.Image:
    """An opened PIL image as RGB: alpha dropped (as sd-scripts does without ``alpha_mask``), 16-bit and float
    greyscale scaled to 8 bits (0..65535 and 0..1 respectively) rather than clipped."""
    import numpy as np
    from PIL import Image

    if image.mode in HIGH_BIT_GREY_MODES:
        values = np.asarray(image, dtype=np.float64) / 257.0
    elif image.mode == "F":
        values = np.asarray(image, dtype=np.float64)
        values = values * 255.0 if values.size and values.max() <= 1.0 else values
    else:
        return image.convert("RGB")
    grey = np.clip(np.round(values), 0, 255).astype(np.uint8)
    return Image.fromarray(grey).convert("RGB")


def load_image_rgb(path: Path) -> PIL.Image.Image:
    """The image as an RGB PIL image (see :func:`to_rgb`); an undecodable file is a one-line UserError."""
    from PIL import Image, UnidentifiedImageError

    delay = os.environ.get(DECODE_DELAY_ENV)
    if delay:
        import time

        time.sleep(float(delay))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            with Image.open(path) as image:
                return to_rgb(image)
        except Image.DecompressionBombError:
            raise UserError(_bomb_message(path)) from None
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
            what = "the file is truncated" if "truncated" in str(exc).lower() else exc.__class__.__name__
            raise UserError(f"{path}: cannot decode image ({what}); replace or delete the file") from None


def image_to_tensor(image: PIL.Image.Image) -> torch.Tensor:
    """PIL RGB -> float32 CHW in [-1, 1] (kohya's ToTensor + Normalize(0.5, 0.5))."""
    import numpy as np
    import torch

    array = np.asarray(image, dtype=np.float32)
    return torch.from_numpy(array).permute(2, 0, 1).contiguous().div_(127.5).sub_(1.0)


def split_for_validation(paths: list[Path], validation_split: float, validation_seed: int,
                         training: bool) -> list[Path]:
    """sd-scripts' per-subset split: shuffle with the validation seed, training keeps the first
    ceil(n * (1 - split)) images, validation the last round(n * split)."""
    shuffled = list(paths)
    random.Random(validation_seed).shuffle(shuffled)
    if training:
        return shuffled[: math.ceil(len(shuffled) * (1 - validation_split))]
    return shuffled[len(shuffled) - round(len(shuffled) * validation_split):]


_UNSUPPORTED = (("color_aug", lambda s: s.color_aug), ("face_crop_aug_range", lambda s: s.face_crop_aug_range))


@dataclass
class TrainDataset:
    """A scanned, bucketed dataset. Build it with :func:`build_dataset`.

    The caches (``latents``/``latent_files``, ``text_outputs``/``text_files``) are filled by
    ``latent_cache.cache_latents`` and ``text_cache.cache_text_encoder_outputs``; fill them before
    creating DataLoader workers (workers get a copy of the dataset).
    """

    spec: DatasetSpec
    seed: int
    records: list[ImageRecord]
    split: str = "train"  # or "validation"
    prior_loss_weight: float = 1.0
    max_train_steps: int = 0  # only for token_warmup_step given as a fraction
    tag_frequencies: dict[str, dict[str, int]] = field(default_factory=dict)
    latents: dict[int, LatentEntry] = field(default_factory=dict)
    latent_files: dict[int, Path] = field(default_factory=dict)
    text_outputs: dict[int, TextEntry] = field(default_factory=dict)
    text_files: dict[int, Path] = field(default_factory=dict)
    latent_geometry: tuple[int, int] | None = None  # the VAE's (channels, downscale): a cached entry's shape

    # ----- sizes and metadata -----
    def __len__(self) -> int:
        return self.num_batches()

    @property
    def subsets(self) -> tuple[SubsetSpec, ...]:
        return self.spec.subsets

    def subset_of(self, record: ImageRecord) -> SubsetSpec:
        return self.spec.subsets[record.subset_index]

    @property
    def num_train_images(self) -> int:
        """Training images counted with repeats (kohya's ``ss_num_train_images``)."""
        return sum(r.num_repeats for r in self.records if not r.is_reg)

    @property
    def num_reg_images(self) -> int:
        return sum(r.num_repeats for r in self.records if r.is_reg)

    def bucket_counts(self) -> dict[Size, int]:
        """Images per bucket, repeats included, sorted by resolution."""
        counts: dict[Size, int] = {}
        for record in self.records:
            counts[record.bucket] = counts.get(record.bucket, 0) + record.num_repeats
        return dict(sorted(counts.items()))

    def largest_batch(self) -> tuple[int, int, int]:
        """(micro-batch, width, height) of the bucket with the most pixels: the step that needs the most memory."""
        if not self.records:
            return (0, 0, 0)
        (width, height), count = max(self.bucket_counts().items(), key=lambda item: item[0][0] * item[0][1])
        return (min(max(1, self.spec.batch_size), count), width, height)

    def bucket_info(self) -> dict[str, Any]:
        """kohya's ``ss_bucket_info`` shape: buckets by index with resolution and count, mean AR error."""
        counts = self.bucket_counts().items()
        buckets = {i: {"resolution": list(reso), "count": n} for i, (reso, n) in enumerate(counts)}
        errors = [abs(r.assignment.ar_error) for r in self.records]
        return {"buckets": buckets, "mean_img_ar_error": sum(errors) / len(errors) if errors else 0.0}

    def dataset_dirs(self, reg: bool = False) -> dict[str, dict[str, int]]:
        """kohya's ``ss_dataset_dirs`` (``reg``: ``ss_reg_dataset_dirs``): folder name -> repeats and image count."""
        dirs: dict[str, dict[str, int]] = {}
        for i, subset in enumerate(self.spec.subsets):
            if subset.is_reg != reg:
                continue
            count = sum(1 for r in self.records if r.subset_index == i)
            if count:
                dirs[Path(subset.image_dir).name] = {"n_repeats": subset.num_repeats, "img_count": count}
        return dirs

    # ----- order -----
    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        rng = random.Random(mix_seed(self.seed, "epoch", epoch))
        by_bucket: dict[Size, list[int]] = {}
        for record in self.records:
            by_bucket.setdefault(record.bucket, []).extend([record.index] * record.num_repeats)
        batch_size = max(1, self.spec.batch_size)
        batches: list[list[int]] = []
        for bucket in sorted(by_bucket):
            members = by_bucket[bucket]
            rng.shuffle(members)
            batches.extend(members[i: i + batch_size] for i in range(0, len(members), batch_size))
        rng.shuffle(batches)
        return batches

    def num_batches(self, num_replicas: int = 1) -> int:
        """Batches (steps) per epoch for one process."""
        total = sum(math.ceil(n / max(1, self.spec.batch_size)) for n in self.bucket_counts().values())
        return math.ceil(total / num_replicas)

    def batches_for_epoch(self, epoch: int, num_replicas: int = 1, rank: int = 0) -> list[list[int]]:
        """The epoch's batches (lists of record indices), each from one bucket, as kohya orders them:
        every bucket shuffled, cut into ``batch_size`` batches, then all batches shuffled. With several
        processes each takes every ``num_replicas``-th batch; the list is padded by wrapping around so
        all processes run the same number of steps."""
        batches = self._epoch_batches(epoch)
        if num_replicas > 1:
            per_rank = math.ceil(len(batches) / num_replicas)
            padded = batches + batches[: per_rank * num_replicas - len(batches)]
            batches = padded[rank::num_replicas]
        return batches

    # ----- loading -----
    def __getitem__(self, key: BatchKey) -> dict[str, Any]:
        return self.collate(key.items, epoch=key.epoch, step=key.step)

    def collate(self, items: list[int] | tuple[int, ...], *, epoch: int, step: int) -> dict[str, Any]:
        """Load one batch. Keys: ``latents`` (cached) or ``images`` (B,3,H,W in [-1,1]), ``captions``,
        ``loss_weights`` (prior_loss_weight for regularization images), ``is_reg``,
        ``network_multipliers``, ``original_sizes_hw``, ``crop_top_lefts``, ``target_sizes_hw``
        (B,2 long), ``flipped``, ``paths``; with cached text-encoder outputs also
        ``encoder_hidden_states`` and ``pooled`` (SDXL)."""
        import torch

        if not items:
            raise ValueError("empty batch")
        records = [self.records[i] for i in items]
        buckets = {r.bucket for r in records}
        if len(buckets) != 1:
            raise ValueError(f"batch mixes buckets {sorted(buckets)}")
        global_step = epoch * self.num_batches() + step
        pixels, latents, captions, originals, crops, targets, flips = [], [], [], [], [], [], []
        for position, record in enumerate(records):
            subset = self.subset_of(record)
            rng = random.Random(mix_seed(self.seed, self.split, "item", epoch, step, position, record.index))
            flipped = subset.flip_aug and rng.random() < 0.5
            if record.index in self.latents or record.index in self.latent_files:
                geometry = record.center_geometry()
                latents.append(self._cached_latents(record, flipped))
            else:
                geometry = crop_geometry(record.image_size, record.assignment, rng if subset.random_crop else None)
                image = resize_and_crop(load_image_rgb(record.path), geometry)
                if flipped:
                    from PIL import ImageOps

                    image = ImageOps.mirror(image)
                pixels.append(image_to_tensor(image))
            captions.append(process_caption(record.caption, subset, rng, epoch=epoch, step=global_step,
                                            max_train_steps=self.max_train_steps))
            originals.append((geometry.original_size[1], geometry.original_size[0]))
            crops.append(geometry.crop_top_left(flipped))
            targets.append((geometry.bucket[1], geometry.bucket[0]))
            flips.append(flipped)
        if latents and pixels:
            raise ValueError("batch mixes cached and uncached images; cache every image or none")
        batch: dict[str, Any] = {
            "captions": captions,
            "loss_weights": torch.tensor([self.prior_loss_weight if r.is_reg else 1.0 for r in records]),
            "is_reg": torch.tensor([r.is_reg for r in records]),
            "network_multipliers": torch.full((len(records),), float(self.spec.network_multiplier)),
            "original_sizes_hw": torch.tensor(originals, dtype=torch.long),
            "crop_top_lefts": torch.tensor(crops, dtype=torch.long),
            "target_sizes_hw": torch.tensor(targets, dtype=torch.long),
            "flipped": flips,
            "paths": [str(r.path) for r in records],
        }
        if latents:
            batch["latents"] = torch.stack(latents)
        else:
            batch["images"] = torch.stack(pixels)
        text = [self._cached_text(r) for r in records]
        cached = [t for t in text if t is not None]
        if len(cached) == len(text):  # every caption's outputs cached (one family: all with or all without)
            batch["encoder_hidden_states"] = torch.stack([t.encoder_hidden_states for t in cached])
            if cached[0].pooled is not None:
                batch["pooled"] = torch.stack([t.pooled for t in cached if t.pooled is not None])
            if cached[0].attention_mask is not None:
                batch["t5_attn_mask"] = torch.stack([t.attention_mask for t in cached if t.attention_mask is not None])
        return batch

    def _cached_latents(self, record: ImageRecord, flipped: bool) -> torch.Tensor:
        entry = self.latents.get(record.index)
        if entry is None:
            entry = read_latent_file(self.latent_files[record.index], self.latent_shape(record),
                                     self.subset_of(record).flip_aug)
        if flipped:
            if entry.latents_flipped is None:
                raise ValueError(f"{record.path}: flip_aug is on but the latent cache has no flipped latents")
            return entry.latents_flipped
        return entry.latents

    def latent_shape(self, record: ImageRecord) -> tuple[int, int, int] | None:
        """(C, h, w) of the record's latents as the VAE makes them, once caching has told the geometry."""
        if self.latent_geometry is None:
            return None
        channels, downscale = self.latent_geometry
        width, height = record.bucket
        return channels, height // downscale, width // downscale

    def _cached_text(self, record: ImageRecord) -> TextEntry | None:
        entry = self.text_outputs.get(record.index)
        if entry is None and record.index in self.text_files:
            entry = read_text_file(self.text_files[record.index])
        return entry


def _check_subset(subset: SubsetSpec) -> None:
    for key, is_set in _UNSUPPORTED:
        if is_set(subset):
            raise UserError(f"{key} (subset {subset.image_dir}) is not implemented by this engine; remove it")


Entry = tuple[int, Path, str, Size, int]  # (subset index, path, caption, size, repeats)


def _read_subsets(spec: DatasetSpec, *, validating: bool, validation_seed: int, verify_images: bool
                  ) -> tuple[list[Entry], list[Entry], dict[str, dict[str, int]]]:
    """(training entries, regularization entries, tag frequencies per training folder): each subset scanned
    once, its validation share split off by ``validation_seed``, captions read and checked, sizes read."""
    train_entries: list[Entry] = []
    reg_entries: list[Entry] = []
    frequencies: dict[str, dict[str, int]] = {}
    seen: list[SubsetSpec] = []
    for subset_index, subset in enumerate(spec.subsets):
        if subset.num_repeats < 1:
            warnings.warn(f"ignoring subset {subset.image_dir}: num_repeats = {subset.num_repeats} < 1", stacklevel=3)
            continue
        if subset in seen:
            warnings.warn(f"ignoring duplicated subset {subset.image_dir}", stacklevel=3)
            continue
        seen.append(subset)
        _check_subset(subset)
        if validating and subset.is_reg:
            continue
        paths, listing = _scan_dir(Path(subset.image_dir))
        if spec.validation_split > 0 and not subset.is_reg:
            paths = split_for_validation(paths, spec.validation_split, validation_seed, training=not validating)
        repeats = 1 if validating else subset.num_repeats
        captions = []
        empty: list[Path] = []
        for path in paths:
            caption, missing = base_caption(path, subset, warn=False)
            if missing and subset.class_tokens is None:
                empty.append(path)
            size = read_image_size(path) if verify_images else _header_size(path)
            captions.append(caption)
            (reg_entries if subset.is_reg else train_entries).append((subset_index, path, caption, size, repeats))
        _warn_about_captions(subset, paths, captions, empty, listing)
        if not subset.is_reg:
            counts = frequencies.setdefault(Path(subset.image_dir).name, {})
            for tag, n in tag_frequency(captions).items():
                counts[tag] = counts.get(tag, 0) + n
    return train_entries, reg_entries, frequencies


def _balanced_reg_repeats(train_entries: list[Entry], reg_entries: list[Entry]) -> list[int]:
    """kohya's balancing: regularization images are repeated until they match the training images (counted
    with repeats); when there are more, the surplus is left out (the list is shorter than ``reg_entries``)."""
    num_train = sum(e[4] for e in train_entries)
    reg_repeats: list[int] = []
    if reg_entries:
        total = 0
        first_pass = True
        while total < num_train:
            for i, entry in enumerate(reg_entries):
                if first_pass:
                    reg_repeats.append(entry[4])
                    total += entry[4]
                else:
                    reg_repeats[i] += 1
                    total += 1
                if total >= num_train:
                    break
            first_pass = False
        if len(reg_repeats) < len(reg_entries):
            warnings.warn(f"{len(reg_entries) - len(reg_repeats)} regularization images are not used (there are "
                          "more than training images)", stacklevel=3)
    return reg_repeats


def build_dataset(spec: DatasetSpec, *, seed: int, prior_loss_weight: float = 1.0, split: str = "train",
                  verify_images: bool = True) -> TrainDataset:
    """Scan the subsets, read captions and sizes, balance regularization images, assign buckets.

    ``split="validation"`` builds the held-out part of ``validation_split`` (seeded by
    ``validation_seed``, else ``seed``); regularization subsets are never split and never validated.
    Raises a one-line ``UserError`` for a missing folder, a folder without images, a broken image,
    an unusable caption file or an unsupported augmentation key.
    """
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', not {split!r}")
    bucket_config = BucketConfig.of(spec)
    bucket_config.check()
    if not 0.0 <= spec.validation_split < 1.0:
        raise UserError(f"validation_split = {spec.validation_split} must be in [0, 1)")
    validating = split == "validation"
    if validating and spec.validation_split <= 0:
        raise ValueError("no validation split configured (validation_split = 0)")
    validation_seed = spec.validation_seed if spec.validation_seed is not None else seed
    predefined = bucket_config.predefined()

    train_entries, reg_entries, frequencies = _read_subsets(spec, validating=validating,
                                                            validation_seed=validation_seed,
                                                            verify_images=verify_images)
    if not train_entries:
        raise UserError("the dataset has no training images (only regularization subsets?); add a training subset")

    reg_repeats = _balanced_reg_repeats(train_entries, reg_entries)

    records: list[ImageRecord] = []
    chosen = [(e, False, e[4]) for e in train_entries] + [(e, True, n) for e, n in zip(reg_entries, reg_repeats)]
    for (subset_index, path, caption, size, _), is_reg, repeats in chosen:
        try:
            assignment = bucket_config.assign(size, predefined)
        except ValueError as exc:
            raise UserError(f"{path}: {exc}; use a larger image or a smaller bucket_reso_steps") from None
        records.append(ImageRecord(len(records), path, caption, subset_index, is_reg, repeats, size, assignment))
    return TrainDataset(spec=spec, seed=seed, records=records, split=split, prior_loss_weight=prior_loss_weight,
                        tag_frequencies=frequencies)


def _header_size(path: Path) -> Size:
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                return image.size
    except Image.DecompressionBombError:
        raise UserError(_bomb_message(path)) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise UserError(f"{path}: cannot read image ({exc.__class__.__name__}); replace or delete the file") from None


def build_validation_dataset(spec: DatasetSpec, *, seed: int, prior_loss_weight: float = 1.0) -> TrainDataset | None:
    """The held-out images of ``validation_split`` as their own dataset, or None when it is 0."""
    if spec.validation_split <= 0:
        return None
    return build_dataset(spec, seed=seed, prior_loss_weight=prior_loss_weight, split="validation")


# ----- DataLoader -----

class BucketBatchSampler:
    """Yields one :class:`BatchKey` per step of an epoch (use with ``DataLoader(batch_size=None)``).

    Lives in the main process, so ``set_epoch`` works with persistent workers; ``start_step`` skips
    the steps a resumed run already did.
    """

    def __init__(self, dataset: TrainDataset, *, epoch: int = 0, start_step: int = 0, num_replicas: int = 1,
                 rank: int = 0) -> None:
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.set_epoch(epoch, start_step)

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        self.epoch = epoch
        self.start_step = start_step

    def __iter__(self):
        batches = self.dataset.batches_for_epoch(self.epoch, self.num_replicas, self.rank)
        for step in range(self.start_step, len(batches)):
            yield BatchKey(self.epoch, step, tuple(batches[step]))

    def __len__(self) -> int:
        return max(0, self.dataset.num_batches(self.num_replicas) - self.start_step)


def make_dataloader(dataset: TrainDataset, sampler: BucketBatchSampler, *, num_workers: int = 0,
                    persistent_workers: bool = False, pin_memory: bool = False) -> torch.utils.data.DataLoader[Any]:
    """A torch DataLoader over whole batches (kohya's ``max_data_loader_n_workers`` and
    ``persistent_data_loader_workers``); ``persistent_workers`` needs ``num_workers > 0``."""
    import torch
    from torch.utils.data import DataLoader

    # Its own generator: each new iterator draws a worker base seed, and drawing it from the global RNG
    # would shift dropout noise between a straight run and a resumed one.
    generator = torch.Generator().manual_seed(dataset.seed)
    return DataLoader(cast(Any, dataset), sampler=sampler, batch_size=None, num_workers=num_workers,
                      persistent_workers=persistent_workers and num_workers > 0, pin_memory=pin_memory,
                      generator=generator, worker_init_fn=ignore_sigint if num_workers > 0 else None)


def ignore_sigint(_worker_id: int) -> None:
    """In a DataLoader worker: Ctrl-C reaches the terminal's whole process group, and a worker would exit at it
    while the main process finishes its step (which then fails for want of the batch in flight). The main process
    stops at a step boundary and shuts its workers down itself. SIGTERM keeps its default: that is how torch and
    multiprocessing end workers that do not stop, and a worker ignoring it would hang the exit."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
