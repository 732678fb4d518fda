"""Training resolutions and bucket rules, one set for every family.

Families train in 64 px steps (kohya's ``bucket_reso_steps`` default: 8 latent pixels of an 8x VAE) down to
5/8 of their native size, buckets never below 256 px. The tiny test twins' VAEs downsample 8x like the
full-size ones, so they exercise the same bucket arithmetic; all that is left of their special case is
that a CPU plan of one is capped to a short run (``TINY_CPU_MAX_STEPS``).
"""

from __future__ import annotations

from sd_scripts_compat.facts.families import FamilySpec

RESOLUTION_STEP = 64  # kohya's bucket_reso_steps default; latents must be multiples of 8 px, buckets of 64
MIN_RESOLUTION_FRACTION = 5 / 8  # 1024 -> 640, 512 -> 320: below that a family's outputs fall apart
MIN_BUCKET_RESO = 256  # the smallest bucket side (and --resolution) of a full-size family
TINY_CPU_MAX_STEPS = 40  # quickstart on a 2-core CPU: ~1 s per step, about a minute with startup


def is_tiny_scale(family: FamilySpec) -> bool:
    """A demo/test family (``tiny`` in its data): CPU plans of it are capped to TINY_CPU_MAX_STEPS."""
    return family.tiny


def step_and_floor(family: FamilySpec) -> tuple[int, int]:
    """(resolution step, smallest bucket side) in px: what the planner's buckets and the OOM ladder use.

    The same for every family (``family`` stays in the signature: a family whose VAE downsampled otherwise
    would need another step)."""
    return RESOLUTION_STEP, MIN_BUCKET_RESO


def bucket_rules(family: FamilySpec, resolution: int) -> tuple[int, int]:
    """(bucket_reso_steps, min_bucket_reso) for a family at a training resolution: half the resolution,
    in bucket steps, never below 256 px (nor above the resolution itself, for a small pinned one)."""
    step, floor = step_and_floor(family)
    return step, max(min(floor, resolution // step * step), resolution // 2 // step * step)


def bucket_step_reason(step: int) -> str:
    """Why buckets go in ``step`` px: 8 latent pixels of the family's VAE."""
    return f"bucket sides in {step} px steps (kohya's default, 8 latent pixels)"


def resolution_floor(native: int) -> int:
    """The lowest resolution the planner gives up to: 5/8 of the native size in 64 px steps, never below 256 px
    (the search lowers in 64 px steps from the native or pinned size down to it: ``settings_space``'s rung)."""
    return max(MIN_BUCKET_RESO, int(native * MIN_RESOLUTION_FRACTION) // RESOLUTION_STEP * RESOLUTION_STEP)
