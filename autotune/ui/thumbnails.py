"""A dataset image as the engine will train it: assigned to its bucket, resized and cropped by the engine's own
functions (``BucketConfig.assign``, ``crop_geometry``, ``resize_and_crop``, centre crop), then shrunk to a
thumbnail. The doctor's problem rows show these, so a user sees what the crop cuts off before training."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

THUMBNAIL_SIDE = 192  # the longer side of a thumbnail, in pixels


def cropped_thumbnail(image_path: Path, model: str | None, resolution: int | None) -> tuple[bytes, dict[str, Any]]:
    """(PNG bytes, what happened: original size, bucket, resized size, crop offsets) for one image, with the
    bucket rules the doctor uses for ``model`` (a full-size family's without one) at ``resolution``."""
    from PIL import Image

    from autotune.doctor.buckets import DEFAULT_RESOLUTION, STAND_IN_FAMILY, bucket_config
    from autotune.doctor.diagnose import resolve_family
    from sd_scripts_compat.dataset.buckets import crop_geometry, resize_and_crop
    from sd_scripts_compat.dataset.train_dataset import load_image_rgb
    from sd_scripts_compat.models.detect import known_family

    spec = resolve_family(model, None) if model else None
    side = resolution or (spec.resolution if spec else DEFAULT_RESOLUTION)
    config = bucket_config(spec or known_family(STAND_IN_FAMILY), side)
    image = load_image_rgb(image_path)  # UserError for a file that does not decode: the caller's 4xx
    geometry = crop_geometry(image.size, config.assign(image.size, config.predefined()))
    cropped = resize_and_crop(image, geometry)
    cropped.thumbnail((THUMBNAIL_SIDE, THUMBNAIL_SIDE), Image.Resampling.LANCZOS)
    buffer = io.BytesIO()
    cropped.save(buffer, format="PNG")
    return buffer.getvalue(), {"original": list(geometry.original_size), "resized": list(geometry.resized_size),
                               "bucket": list(geometry.bucket), "crop_left": geometry.crop_left,
                               "crop_top": geometry.crop_top}
