"""Bucket sets, assignment and crop geometry against kohya's rules."""

from __future__ import annotations

import random

import pytest
from PIL import Image

from sd_scripts_compat.dataset.buckets import (
    BucketConfig,
    crop_geometry,
    make_bucket_resolutions,
    resize_and_crop,
    select_bucket,
    select_bucket_no_upscale,
)
from sd_scripts_compat.facts.errors import UserError


@pytest.mark.parametrize("reso,max_size", [((512, 512), 1024), ((1024, 1024), 2048)])
def test_bucket_set_follows_kohya_rules(reso, max_size):
    resos = make_bucket_resolutions(reso, 256, max_size, 64)
    area = reso[0] * reso[1]
    assert reso in resos
    assert len(set(resos)) == len(resos)
    for w, h in resos:
        assert w % 64 == 0 and h % 64 == 0
        assert 256 <= w <= max_size and 256 <= h <= max_size
        assert w * h <= area
        assert (h, w) in resos  # symmetric
    # exactly: the square of the area, and for each width the tallest fitting height (+ transpose)
    widths = range(256, max_size + 1, 64)
    assert len(resos) == len({(w, min(max_size, (area // w) // 64 * 64)) for w in widths
                              if min(max_size, (area // w) // 64 * 64) >= 256}
                             | {(min(max_size, (area // w) // 64 * 64), w) for w in widths
                                if min(max_size, (area // w) // 64 * 64) >= 256} | {reso})


def test_known_aspect_ratios_and_exact_match():
    resos = make_bucket_resolutions((512, 512))
    assert select_bucket((512, 512), resos).bucket == (512, 512)
    assert select_bucket((2048, 2048), resos).bucket == (512, 512)
    wide = select_bucket((1000, 500), resos)  # 2.0 -> closest is 704x320 (2.2) vs 640x384 (1.67)
    assert wide.bucket == (704, 320)
    assert wide.resized_size == (704, 352)  # covers the bucket, height cropped
    tall = select_bucket((600, 800), resos)  # 0.75 -> 448x576 (0.78)
    assert tall.bucket == (448, 576)
    assert tall.resized_size[0] == 448 and tall.resized_size[1] >= 576
    # an image already at a bucket's size goes there even if another bucket has the same ratio
    assert select_bucket((576, 448), resos).bucket == (576, 448)


def test_no_upscale_never_enlarges_and_rounds_down():
    small = select_bucket_no_upscale((300, 200), 512 * 512, 64)
    assert small.bucket == (256, 192)
    assert small.resized_size == (300, 200)
    big = select_bucket_no_upscale((3000, 2000), 512 * 512, 64)
    assert big.bucket[0] * big.bucket[1] <= 512 * 512
    assert big.bucket[0] % 64 == 0 and big.bucket[1] % 64 == 0
    assert big.resized_size[0] >= big.bucket[0] and big.resized_size[1] >= big.bucket[1]
    with pytest.raises(ValueError):
        select_bucket_no_upscale((40, 40), 512 * 512, 64)
    config = BucketConfig((512, 512), enable_bucket=True, bucket_no_upscale=True)
    assert config.assign((300, 200)).bucket == (256, 192)


def test_disabled_bucketing_uses_the_resolution():
    config = BucketConfig((512, 512), enable_bucket=False)
    for size in [(1000, 500), (300, 800), (512, 512)]:
        assignment = config.assign(size)
        assert assignment.bucket == (512, 512)
        assert min(assignment.resized_size) == 512


def test_config_checks_name_the_key():
    with pytest.raises(UserError, match="min_bucket_reso"):
        BucketConfig((512, 512), enable_bucket=True, min_bucket_reso=640).check()
    with pytest.raises(UserError, match="max_bucket_reso"):
        BucketConfig((1024, 1024), enable_bucket=True, max_bucket_reso=768).check()


def test_crop_geometry_center_random_and_flip():
    resos = make_bucket_resolutions((512, 512))
    assignment = select_bucket((1000, 500), resos)
    center = crop_geometry((1000, 500), assignment)
    assert (center.crop_left, center.crop_top) == (0, 16)  # 704x352 -> 704x320
    assert center.crop_top_left() == (16, 0)
    wide = select_bucket((2200, 500), resos)  # 4.4 -> 1024x256, resized 1126x256
    geometry = crop_geometry((2200, 500), wide)
    assert wide.bucket == (1024, 256)
    excess = geometry.resized_size[0] - geometry.bucket[0]
    assert geometry.crop_left == excess // 2
    lefts = {crop_geometry((2200, 500), wide, random.Random(s)).crop_left for s in range(20)}
    assert len(lefts) > 1 and all(0 <= x <= excess for x in lefts)
    # flip mirrors the left offset
    g = crop_geometry((2200, 500), wide, random.Random(3))
    assert g.crop_top_left(flipped=True) == (g.crop_top, g.resized_size[0] - g.crop_left - g.bucket[0])


def test_resize_and_crop_produces_bucket_size():
    image = Image.new("RGB", (1000, 500), (10, 20, 30))
    assignment = select_bucket((1000, 500), make_bucket_resolutions((512, 512)))
    out = resize_and_crop(image, crop_geometry((1000, 500), assignment))
    assert out.size == assignment.bucket
