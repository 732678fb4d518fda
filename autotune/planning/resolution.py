"""Training resolutions and bucket rules, with the tiny test families' special case kept in this one place.

Full-size families train in 64 px steps (kohya's ``bucket_reso_steps`` default: 8 latent pixels of an
8x VAE) down to 5/8 of their native size, buckets never below 256 px. The tiny families (native size
< 256 px, demos and tests) get their own step and floor, and a CPU plan of one is capped to a short run.
"""

from __future__ import annotations

from sd_scripts_compat.models.families import FamilySpec

RESOLUTION_STEP = 64  # kohya's bucket_reso_steps default; latents must be multiples of 8 px, buckets of 64
MIN_RESOLUTION_FRACTION = 5 / 8  # 1024 -> 640, 512 -> 320: below that a family's outputs fall apart
MIN_BUCKET_RESO = 256  # the smallest bucket side (and --resolution) of a full-size family
# Tiny test families (native size < 256 px; their VAE downsamples 2x, not 8x): buckets in 16 px steps
# (8 latent pixels, as 64 px is for the full-size VAEs) from 32 px up, the same floor and step the OOM
# ladder uses for them in `autotune run`.
TINY_NATIVE_BELOW = 256
TINY_RESOLUTION_STEP = 16
TINY_MIN_BUCKET_RESO = 32
TINY_CPU_MAX_STEPS = 40  # quickstart on a 2-core CPU: ~1 s per step, about a minute with startup


def is_tiny_scale(family: FamilySpec) -> bool:
    """A demo/test-sized family: its own bucket rules, and CPU plans capped to TINY_CPU_MAX_STEPS."""
    return family.resolution < TINY_NATIVE_BELOW


def step_and_floor(family: FamilySpec) -> tuple[int, int]:
    """(resolution step, smallest bucket side) in px: what the planner's buckets and the OOM ladder use."""
    return (TINY_RESOLUTION_STEP, TINY_MIN_BUCKET_RESO) if is_tiny_scale(family) else (RESOLUTION_STEP,
                                                                                        MIN_BUCKET_RESO)


def bucket_rules(family: FamilySpec, resolution: int) -> tuple[int, int]:
    """(bucket_reso_steps, min_bucket_reso) for a family at a training resolution: half the resolution,
    in bucket steps, never below 256 px (tiny families: 32 px, 16 px steps; see TINY_RESOLUTION_STEP)."""
    step, floor = step_and_floor(family)
    return step, max(floor, resolution // 2 // step * step)


def bucket_step_reason(step: int) -> str:
    """Why buckets go in ``step`` px: 8 latent pixels of the family's VAE."""
    return f"bucket sides in {step} px steps (" + ("kohya's default, 8 latent pixels)" if step == RESOLUTION_STEP
                                                   else "8 latent pixels: the tiny VAE downsamples 2x)")


def resolution_ladder(native: int, pinned: int | None) -> list[int]:
    """The resolutions the search may try, largest first: the pinned or native size, then 64 px steps down
    to 5/8 of the native size (never below 256 px)."""
    top = pinned or native
    floor = max(MIN_BUCKET_RESO, int(native * MIN_RESOLUTION_FRACTION) // RESOLUTION_STEP * RESOLUTION_STEP)
    out = [top]
    r = top - RESOLUTION_STEP
    while r >= floor:
        out.append(r)
        r -= RESOLUTION_STEP
    return out
