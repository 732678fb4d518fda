"""Aspect-ratio buckets as the engine will build them, and the true steps per epoch.

The bucket settings are the planner's (``autotune.planning.resolution.bucket_rules``: step and smallest
bucket side for the family and resolution, ``max_bucket_reso`` twice the resolution, ``bucket_no_upscale``),
each image is assigned with the engine's ``BucketConfig.assign``, and batches are counted the way the
engine's sampler cuts them (``TrainDataset._epoch_batches``): every bucket on its own, its images times their
repeats cut into batches of ``batch``, the last one short. Nothing is dropped; a bucket with fewer distinct
images than the batch trains in short batches, or repeats the same image inside a batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autotune.doctor.report import ERROR, WARNING, BucketRow, Problem
from autotune.planning.resolution import bucket_rules
from sd_scripts_compat.dataset.buckets import BucketConfig, Size
from sd_scripts_compat.facts.families import FamilySpec

DEFAULT_RESOLUTION = 512  # without --model: SD1.x's native size
STAND_IN_FAMILY = "sd15"  # without --model the bucket rules of a full-size family (all of them share them)


@dataclass(frozen=True)
class BucketItem:
    rel: str
    size: Size
    repeats: int


def bucket_config(family: FamilySpec, resolution: int) -> BucketConfig:
    """The dataset.toml bucket keys the planner writes for this family and resolution (planning/outputs.py)."""
    step, min_bucket = bucket_rules(family, resolution)
    config = BucketConfig((resolution, resolution), enable_bucket=True, min_bucket_reso=min_bucket,
                          max_bucket_reso=resolution * 2, bucket_reso_steps=step, bucket_no_upscale=True)
    config.check()  # kohya's constraints, as the engine checks them: a one-line UserError
    return config


def plan_buckets(items: list[BucketItem], config: BucketConfig,
                 batch: int) -> tuple[tuple[BucketRow, ...], list[Problem], int]:
    """(histogram, problems, steps per epoch) for the usable images."""
    predefined = config.predefined()
    members: dict[Size, list[BucketItem]] = {}
    problems: list[Problem] = []
    for item in items:
        try:
            assignment = config.assign(item.size, predefined)
        except ValueError:
            problems.append(_too_small(item, config))
            continue
        members.setdefault(assignment.bucket, []).append(item)
        problems += _small(item, assignment.bucket, config)
    rows = []
    for bucket in sorted(members):
        views = sum(m.repeats for m in members[bucket])
        batches = math.ceil(views / batch)
        rows.append(BucketRow(bucket[0], bucket[1], len(members[bucket]), views, batches,
                              views - (batches - 1) * batch))
        problems += _under_batch(bucket, members[bucket], views, batch)
    return tuple(rows), problems, sum(r.batches for r in rows)


def _too_small(item: BucketItem, config: BucketConfig) -> Problem:
    w, h = item.size
    return Problem(ERROR, "too-small", item.rel, f"{w} x {h} is smaller than one bucket step "
                   f"({config.bucket_reso_steps} px): it fits no bucket and the engine stops at it",
                   f"use an image at least {config.min_bucket_reso} px on its short side, or delete it")


def _small(item: BucketItem, bucket: Size, config: BucketConfig) -> list[Problem]:
    """A bucket side below min_bucket_reso: bucket_no_upscale keeps a small image small (the engine does not
    apply min_bucket_reso then, as sd-scripts does not), and an elongated image's bucket (same area, coarse steps)
    can have a side below it even at a modest aspect ratio."""
    if min(bucket) >= config.min_bucket_reso:
        return []
    w, h = item.size
    small = min(item.size) < config.min_bucket_reso
    aspect = max(w, h) / min(w, h)
    why = ("bucket_no_upscale keeps small images small" if small else
           f"at resolution {config.resolution[0]} its aspect ratio {aspect:.2f} needs a side that short")
    better = f" (better {config.resolution[0]} px)" if config.resolution[0] > config.min_bucket_reso else ""
    fix = (f"use an image at least {config.min_bucket_reso} px{better} on its short side"
           if small else f"crop it closer to square, or set min_bucket_reso = {min(bucket)}")
    return [Problem(WARNING, "small", item.rel, f"{w} x {h} trains at bucket {bucket[0]} x {bucket[1]}, below the "
                    f"smallest bucket side of {config.min_bucket_reso} px ({why})", fix)]


def _under_batch(bucket: Size, members: list[BucketItem], views: int, batch: int) -> list[Problem]:
    """Each image of a bucket with fewer distinct images than the batch (the engine never mixes buckets)."""
    if len(members) >= batch:
        return []
    where = f"bucket {bucket[0]} x {bucket[1]}"
    if views < batch:
        what = (f"its {where} gets {views} view(s) per epoch, fewer than the batch of {batch}: it always "
                f"trains in a short batch of {views}")
    else:
        what = (f"its {where} holds only {len(members)} image(s) for batches of {batch}; batches never mix "
                "buckets, so the same image repeats inside a batch")
    fix = "add images of this shape, crop it to a more common aspect ratio, or lower the batch"
    return [Problem(WARNING, "bucket-under-batch", m.rel, what, fix) for m in members]
