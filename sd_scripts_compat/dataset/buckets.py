"""Aspect-ratio buckets and the resize-then-crop geometry, with kohya's (sd-scripts) rules.

Sizes are ``(width, height)`` tuples throughout, as in sd-scripts. A bucket is the pixel size a
batch is trained at; every image is resized so that it covers its bucket and then cropped to it,
so no image is padded or distorted. The crop offsets are returned because SDXL is conditioned on
them (``crop_top_left``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sd_scripts_compat.facts.errors import UserError

if TYPE_CHECKING:
    from PIL import Image

    from sd_scripts_compat.facts.dataset_spec import DatasetSpec

Size = tuple[int, int]  # (width, height)


def make_bucket_resolutions(max_reso: Size, min_size: int = 256, max_size: int = 1024,
                            divisible: int = 64) -> list[Size]:
    """kohya's predefined bucket set for a training resolution.

    The square bucket of the resolution's area (rounded down to ``divisible``), plus, for every width
    from ``min_size`` to ``max_size`` in ``divisible`` steps, the tallest height (a multiple of
    ``divisible``, at most ``max_size``) whose area stays within ``max_reso``'s area — and its
    transpose. Only the largest-area bucket per width is kept, as sd-scripts does, so that small
    buckets do not absorb images at a needlessly low resolution.
    """
    max_width, max_height = max_reso
    max_area = max_width * max_height
    resos: set[Size] = set()
    side = int(math.sqrt(max_area) // divisible) * divisible
    resos.add((side, side))
    width = min_size
    while width <= max_size:
        height = min(max_size, int((max_area // width) // divisible) * divisible)
        if height >= min_size:
            resos.add((width, height))
            resos.add((height, width))
        width += divisible
    return sorted(resos)


@dataclass(frozen=True)
class BucketAssignment:
    """Where one image goes: its bucket and the size it is resized to before the crop."""

    bucket: Size
    resized_size: Size
    ar_error: float  # bucket aspect ratio minus image aspect ratio (kohya logs the mean)


def _cover_size(image_size: Size, bucket: Size) -> Size:
    """The smallest aspect-preserving size that covers ``bucket`` (kohya's rounding: int(x + 0.5))."""
    width, height = image_size
    aspect = width / height
    if aspect > bucket[0] / bucket[1]:  # wider than the bucket: match heights, crop the sides
        scale = bucket[1] / height
    else:
        scale = bucket[0] / width
    return int(width * scale + 0.5), int(height * scale + 0.5)


def select_bucket(image_size: Size, resos: list[Size]) -> BucketAssignment:
    """The predefined bucket of the closest aspect ratio (an exact size match wins), may upscale."""
    if not resos:
        raise ValueError("no buckets to choose from")
    width, height = image_size
    aspect = width / height
    if image_size in resos:
        bucket = image_size
    else:
        bucket = min(resos, key=lambda r: abs(r[0] / r[1] - aspect))  # first minimum, like argmin
    return BucketAssignment(bucket, _cover_size(image_size, bucket), bucket[0] / bucket[1] - aspect)


def _round_to_steps(x: float, steps: int) -> int:
    value = int(x + 0.5)
    return value - value % steps


def select_bucket_no_upscale(image_size: Size, max_area: int, steps: int) -> BucketAssignment:
    """kohya's ``bucket_no_upscale``: a bucket from the image's own size, never enlarged.

    An image over ``max_area`` is shrunk (aspect kept) to that area first, with the long or short
    side rounded to ``steps`` — whichever keeps the aspect ratio closer; the bucket is then the
    resized size rounded *down* to ``steps``, so the crop removes less than one step per side.
    """
    width, height = image_size
    aspect = width / height
    if width * height > max_area:
        resized_w = math.sqrt(max_area * aspect)
        resized_h = max_area / resized_w
        w_rounded = _round_to_steps(resized_w, steps)
        h_in_w = _round_to_steps(w_rounded / aspect, steps)
        h_rounded = _round_to_steps(resized_h, steps)
        w_in_h = _round_to_steps(h_rounded * aspect, steps)
        ar_by_width = w_rounded / h_in_w if h_in_w else math.inf
        ar_by_height = w_in_h / h_rounded if h_rounded else math.inf
        if abs(ar_by_width - aspect) < abs(ar_by_height - aspect):
            resized = (w_rounded, int(w_rounded / aspect + 0.5))
        else:
            resized = (int(h_rounded * aspect + 0.5), h_rounded)
    else:
        resized = (width, height)
    bucket = (resized[0] - resized[0] % steps, resized[1] - resized[1] % steps)
    if bucket[0] <= 0 or bucket[1] <= 0:
        shrunk = "" if resized == (width, height) else f", shrunk to {resized[0]}x{resized[1]} for the training area,"
        raise ValueError(f"image {width}x{height}{shrunk} is narrower than one bucket step ({steps} px) on its short "
                         "side; train at a higher resolution, crop the image closer to square, or lower "
                         "bucket_reso_steps")
    return BucketAssignment(bucket, resized, bucket[0] / bucket[1] - aspect)


@dataclass(frozen=True)
class BucketConfig:
    """The bucketing keys of one dataset (kohya's names); ``resolution`` is (width, height)."""

    resolution: Size
    enable_bucket: bool = False
    min_bucket_reso: int = 256
    max_bucket_reso: int = 1024
    bucket_reso_steps: int = 64
    bucket_no_upscale: bool = False

    @classmethod
    def of(cls, spec: DatasetSpec) -> BucketConfig:
        """The bucketing keys of a resolved ``DatasetSpec``, as the dataset builder uses them."""
        return cls(spec.resolution, spec.enable_bucket, spec.min_bucket_reso, spec.max_bucket_reso,
                   spec.bucket_reso_steps, spec.bucket_no_upscale)

    def check(self) -> None:
        """kohya's constraints, as one-line errors naming the key."""
        if self.resolution[0] <= 0 or self.resolution[1] <= 0:
            raise UserError(f"resolution {self.resolution} must be positive (e.g. resolution = \"512,512\")")
        if not self.enable_bucket:
            return
        if self.bucket_reso_steps <= 0:
            raise UserError(f"bucket_reso_steps = {self.bucket_reso_steps} must be positive (64 is kohya's default)")
        if min(self.resolution) < self.min_bucket_reso:
            raise UserError(f"min_bucket_reso = {self.min_bucket_reso} is larger than the resolution "
                            f"{self.resolution}; lower min_bucket_reso or raise resolution")
        if max(self.resolution) > self.max_bucket_reso:
            raise UserError(f"max_bucket_reso = {self.max_bucket_reso} is smaller than the resolution "
                            f"{self.resolution}; raise max_bucket_reso or lower resolution")

    def predefined(self) -> list[Size]:
        """The fixed bucket list (empty with ``bucket_no_upscale``: buckets then come from the images)."""
        if not self.enable_bucket:
            return [self.resolution]
        if self.bucket_no_upscale:
            return []
        return make_bucket_resolutions(self.resolution, self.min_bucket_reso, self.max_bucket_reso,
                                       self.bucket_reso_steps)

    def assign(self, image_size: Size, resos: list[Size] | None = None) -> BucketAssignment:
        """The bucket for one image. ``enable_bucket=False`` puts every image in one bucket of the
        resolution (resize to cover, then crop), as sd-scripts does when it caches latents."""
        if self.enable_bucket and self.bucket_no_upscale:
            return select_bucket_no_upscale(image_size, self.resolution[0] * self.resolution[1],
                                            self.bucket_reso_steps)
        return select_bucket(image_size, resos if resos is not None else self.predefined())


@dataclass(frozen=True)
class CropGeometry:
    """How an image becomes its bucket: resize to ``resized_size``, then cut ``bucket`` at (left, top).

    Offsets are in resized-image pixels — what the crop really removed, which is what SDXL's
    ``crop_top_left`` conditioning means.
    """

    original_size: Size
    resized_size: Size
    bucket: Size
    crop_left: int
    crop_top: int

    def crop_top_left(self, flipped: bool = False) -> tuple[int, int]:
        """(top, left) for SDXL; a horizontal flip mirrors the left offset."""
        if flipped:
            return self.crop_top, self.resized_size[0] - self.crop_left - self.bucket[0]
        return self.crop_top, self.crop_left


def crop_geometry(image_size: Size, assignment: BucketAssignment, rng: random.Random | None = None) -> CropGeometry:
    """Center crop, or a uniformly random crop when ``rng`` is given (``random_crop``)."""
    (rw, rh), (bw, bh) = assignment.resized_size, assignment.bucket
    if rw < bw or rh < bh:
        raise ValueError(f"resized size {rw}x{rh} does not cover bucket {bw}x{bh}")
    excess_w, excess_h = rw - bw, rh - bh
    if rng is None:
        left, top = excess_w // 2, excess_h // 2
    else:
        left, top = rng.randint(0, excess_w), rng.randint(0, excess_h)
    return CropGeometry((image_size[0], image_size[1]), (rw, rh), (bw, bh), left, top)


def resize_and_crop(image: Image.Image, geometry: CropGeometry) -> Image.Image:
    """Apply ``geometry`` to a PIL image (Lanczos; Pillow's filter antialiases when shrinking, which
    stands in for the OpenCV INTER_AREA kohya uses there — we do not depend on OpenCV)."""
    from PIL import Image as PILImage

    if image.size != geometry.resized_size:
        image = image.resize(geometry.resized_size, resample=PILImage.Resampling.LANCZOS)
    left, top = geometry.crop_left, geometry.crop_top
    return image.crop((left, top, left + geometry.bucket[0], top + geometry.bucket[1]))
