"""Dataset scanning, repeats, regularization balancing, bucket batches and deterministic order."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from sd_scripts_compat.dataset.train_dataset import (
    BucketBatchSampler,
    build_dataset,
    build_validation_dataset,
    make_dataloader,
)
from sd_scripts_compat.facts.dataset_spec import DatasetSpec, SubsetSpec
from sd_scripts_compat.facts.errors import UserError

SIZES = [(64, 64), (96, 48), (48, 96), (80, 64), (64, 80), (128, 64)]


def make_images(folder: Path, count: int, caption: str | None = "a photo", sizes=SIZES) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        w, h = sizes[i % len(sizes)]
        image = Image.new("RGB", (w, h), ((i * 37) % 256, (i * 91) % 256, 128))
        image.putpixel((0, 0), (255, 0, 0))
        path = folder / f"img{i:02d}.png"
        image.save(path)
        if caption is not None:
            (folder / f"img{i:02d}.txt").write_text(f"{caption} {i}, tag{i % 3}", encoding="utf-8")
        paths.append(path)
    return paths


def spec_for(*subsets: SubsetSpec, **kwargs) -> DatasetSpec:
    base = dict(resolution=(64, 64), batch_size=2, enable_bucket=True, min_bucket_reso=32, max_bucket_reso=128,
                bucket_reso_steps=16)
    base.update(kwargs)
    return DatasetSpec(subsets=subsets, **base)


def test_scan_repeats_captions_and_metadata(tmp_path):
    make_images(tmp_path / "3_sks", 6)
    spec = spec_for(SubsetSpec(str(tmp_path / "3_sks"), num_repeats=3, caption_extension=".txt"))
    dataset = build_dataset(spec, seed=1)
    assert len(dataset.records) == 6
    assert dataset.num_train_images == 18 and dataset.num_reg_images == 0
    assert sum(dataset.bucket_counts().values()) == 18
    assert dataset.records[0].caption == "a photo 0, tag0"
    assert dataset.tag_frequencies["3_sks"]["tag0"] == 2
    assert dataset.dataset_dirs() == {"3_sks": {"n_repeats": 3, "img_count": 6}}
    assert len(dataset.bucket_info()["buckets"]) == len(dataset.bucket_counts())
    steps = sum(-(-n // 2) for n in dataset.bucket_counts().values())
    assert len(dataset) == steps == len(dataset.batches_for_epoch(0))
    assert sorted(i for b in dataset.batches_for_epoch(0) for i in b) == sorted(
        r.index for r in dataset.records for _ in range(r.num_repeats))


def test_regularization_balancing_matches_train_count(tmp_path):
    make_images(tmp_path / "train", 4)
    make_images(tmp_path / "reg", 3, caption=None)
    spec = spec_for(SubsetSpec(str(tmp_path / "train"), num_repeats=2, caption_extension=".txt"),
                    SubsetSpec(str(tmp_path / "reg"), num_repeats=1, is_reg=True, class_tokens="dog"))
    dataset = build_dataset(spec, seed=0, prior_loss_weight=0.5)
    assert dataset.num_train_images == 8
    assert dataset.num_reg_images == 8  # 3 reg images repeated 3, 3, 2 times
    assert sorted(r.num_repeats for r in dataset.records if r.is_reg) == [2, 3, 3]
    reg = next(r for r in dataset.records if r.is_reg)
    assert reg.caption == "dog"
    batch = dataset.collate([reg.index], epoch=0, step=0)
    assert batch["loss_weights"].tolist() == [0.5] and batch["is_reg"].tolist() == [True]
    # more reg images than training images: the surplus is left out
    make_images(tmp_path / "reg_many", 12, caption=None)
    spec = spec_for(SubsetSpec(str(tmp_path / "train"), num_repeats=1, caption_extension=".txt"),
                    SubsetSpec(str(tmp_path / "reg_many"), is_reg=True, class_tokens="dog"))
    with pytest.warns(UserWarning, match="not used"):
        dataset = build_dataset(spec, seed=0)
    assert dataset.num_reg_images == 4


def test_bad_inputs_are_one_line_user_errors(tmp_path):
    with pytest.raises(UserError, match="missing"):
        build_dataset(spec_for(SubsetSpec(str(tmp_path / "missing"))), seed=0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no images"):
        build_dataset(spec_for(SubsetSpec(str(tmp_path / "empty"))), seed=0)
    make_images(tmp_path / "broken", 2)
    (tmp_path / "broken" / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    with pytest.raises(UserError, match="bad.png") as info:
        build_dataset(spec_for(SubsetSpec(str(tmp_path / "broken"))), seed=0)
    assert "\n" not in str(info.value)
    make_images(tmp_path / "ok", 2)
    with pytest.raises(UserError, match="color_aug"):
        build_dataset(spec_for(SubsetSpec(str(tmp_path / "ok"), color_aug=True)), seed=0)
    with pytest.raises(UserError, match="face_crop_aug_range"):
        build_dataset(spec_for(SubsetSpec(str(tmp_path / "ok"), face_crop_aug_range=(2.0, 4.0))), seed=0)


def test_batches_never_mix_buckets_and_order_is_deterministic(tmp_path):
    make_images(tmp_path / "5_x", 12)
    spec = spec_for(SubsetSpec(str(tmp_path / "5_x"), num_repeats=5, caption_extension=".txt"), batch_size=3)
    dataset = build_dataset(spec, seed=42)
    again = build_dataset(spec, seed=42)
    for epoch in range(3):
        for batch in dataset.batches_for_epoch(epoch):
            assert 1 <= len(batch) <= 3
            assert len({dataset.records[i].bucket for i in batch}) == 1
    assert dataset.batches_for_epoch(1) == again.batches_for_epoch(1)
    assert dataset.batches_for_epoch(0) != dataset.batches_for_epoch(1)
    assert build_dataset(spec, seed=43).batches_for_epoch(0) != dataset.batches_for_epoch(0)
    # two processes: disjoint halves of equal length
    rank0, rank1 = dataset.batches_for_epoch(2, 2, 0), dataset.batches_for_epoch(2, 2, 1)
    assert len(rank0) == len(rank1) == dataset.num_batches(2)


def test_collate_images_and_sdxl_fields(tmp_path):
    make_images(tmp_path / "1_x", 6)
    spec = spec_for(SubsetSpec(str(tmp_path / "1_x"), caption_extension=".txt", flip_aug=True, shuffle_caption=True))
    dataset = build_dataset(spec, seed=3)
    batch_ids = dataset.batches_for_epoch(0)[0]
    batch = dataset.collate(batch_ids, epoch=0, step=0)
    record = dataset.records[batch_ids[0]]
    bw, bh = record.bucket
    assert batch["images"].shape == (len(batch_ids), 3, bh, bw)
    assert batch["images"].dtype == torch.float32
    assert batch["images"].min() >= -1.0 and batch["images"].max() <= 1.0
    assert batch["target_sizes_hw"][0].tolist() == [bh, bw]
    assert batch["original_sizes_hw"][0].tolist() == [record.image_size[1], record.image_size[0]]
    assert batch["crop_top_lefts"].shape == (len(batch_ids), 2)
    assert len(batch["captions"]) == len(batch_ids) and len(batch["flipped"]) == len(batch_ids)
    again = dataset.collate(batch_ids, epoch=0, step=0)
    assert torch.equal(batch["images"], again["images"]) and batch["captions"] == again["captions"]
    # flips really mirror the pixels
    flips = [dataset.collate([record.index], epoch=e, step=0) for e in range(8)]
    flipped = [b for b in flips if b["flipped"][0]]
    plain = [b for b in flips if not b["flipped"][0]]
    assert flipped and plain
    assert torch.equal(flipped[0]["images"], torch.flip(plain[0]["images"], dims=[3]))


def test_no_bucket_mode_resizes_to_resolution(tmp_path):
    make_images(tmp_path / "1_x", 6)
    dataset = build_dataset(spec_for(SubsetSpec(str(tmp_path / "1_x")), enable_bucket=False), seed=0)
    assert set(dataset.bucket_counts()) == {(64, 64)}
    batch = dataset.collate(dataset.batches_for_epoch(0)[0], epoch=0, step=0)
    assert batch["images"].shape[-2:] == (64, 64)


def test_validation_split_is_disjoint_and_seeded(tmp_path):
    make_images(tmp_path / "2_x", 10)
    make_images(tmp_path / "reg", 2, caption=None)
    spec = spec_for(SubsetSpec(str(tmp_path / "2_x"), num_repeats=2),
                    SubsetSpec(str(tmp_path / "reg"), is_reg=True, class_tokens="c"),
                    validation_split=0.3, validation_seed=5)
    train = build_dataset(spec, seed=0)
    val = build_validation_dataset(spec, seed=0)
    train_paths = {r.path for r in train.records if not r.is_reg}
    val_paths = {r.path for r in val.records}
    assert len(train_paths) == 7 and len(val_paths) == 3 and not train_paths & val_paths
    assert all(not r.is_reg and r.num_repeats == 1 for r in val.records)
    assert {r.path for r in build_validation_dataset(spec, seed=99).records} == val_paths  # validation_seed wins
    assert build_validation_dataset(spec_for(SubsetSpec(str(tmp_path / "2_x"))), seed=0) is None


def test_dataloader_with_workers_matches_direct_collate(tmp_path):
    make_images(tmp_path / "2_x", 6)
    spec = spec_for(SubsetSpec(str(tmp_path / "2_x"), num_repeats=2, caption_extension=".txt", shuffle_caption=True))
    dataset = build_dataset(spec, seed=11)
    sampler = BucketBatchSampler(dataset, epoch=1, start_step=2)
    loader = make_dataloader(dataset, sampler, num_workers=2, persistent_workers=True, pin_memory=False)
    expected = dataset.batches_for_epoch(1)[2:]
    got = list(loader)
    assert len(got) == len(expected) == len(sampler)
    for step, (batch, ids) in enumerate(zip(got, expected), start=2):
        direct = dataset.collate(ids, epoch=1, step=step)
        assert torch.equal(batch["images"], direct["images"]) and batch["captions"] == direct["captions"]
    sampler.set_epoch(2)
    assert len(list(loader)) == len(dataset.batches_for_epoch(2))


def test_engine_loader_scales_16_bit_greyscale_to_8_bits(tmp_path):
    """Pillow's convert("RGB") clips a 16-bit grey PNG (I;16) to white; the loader scales it (x / 257)."""
    import numpy as np

    from sd_scripts_compat.dataset.train_dataset import load_image_rgb

    gradient = np.linspace(0, 65535, 64 * 64).reshape(64, 64).astype(np.uint16)
    Image.fromarray(gradient).save(tmp_path / "grey16.png")
    with Image.open(tmp_path / "grey16.png") as opened:
        assert opened.mode.startswith("I")  # really stored as 16 bits
    rgb = np.asarray(load_image_rgb(tmp_path / "grey16.png"))
    assert rgb.shape == (64, 64, 3) and rgb.dtype == np.uint8
    assert np.array_equal(rgb[..., 0], np.round(gradient / 257).astype(np.uint8))
    assert abs(rgb.mean() - 127.5) < 1  # not the 99.6 % white picture convert("RGB") makes


def test_an_image_broken_after_the_scan_is_one_line_from_a_dataloader_worker(tmp_path):
    """torch re-raises a worker's UserError with the worker's traceback in its message; one_line recovers the
    user's line (what train_network and autotune print)."""
    from sd_scripts_compat.facts.errors import one_line

    make_images(tmp_path / "1_x", 2)
    dataset = build_dataset(spec_for(SubsetSpec(str(tmp_path / "1_x")), batch_size=1), seed=0)
    (tmp_path / "1_x" / "img01.png").write_bytes(b"not a picture any more")
    loader = make_dataloader(dataset, BucketBatchSampler(dataset), num_workers=1)
    with pytest.raises(UserError) as raised:
        list(loader)
    assert "Original Traceback" in str(raised.value)  # what torch hands the main process
    line = one_line(raised.value)
    assert line.startswith(str(tmp_path / "1_x" / "img01.png")) and "cannot decode image" in line
    assert "\n" not in line and "Traceback" not in line


def test_bomb_and_truncated_jpeg_are_one_line_errors_naming_the_file(tmp_path):
    import io

    import numpy as np

    from sd_scripts_compat.dataset.train_dataset import load_image_rgb, read_image_size

    Image.new("1", (20000, 20000)).save(tmp_path / "huge.png")  # 400 MP in ~50 KB
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (96, 96, 3), dtype=np.uint8)).save(buffer, "JPEG")
    (tmp_path / "cut.jpg").write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    for reader in (read_image_size, load_image_rgb):
        with pytest.raises(UserError, match="decompression-bomb limit") as bomb:
            reader(tmp_path / "huge.png")
        assert str(tmp_path / "huge.png") in str(bomb.value) and "\n" not in str(bomb.value)
        with pytest.raises(UserError, match="truncated") as cut:
            reader(tmp_path / "cut.jpg")
        assert str(tmp_path / "cut.jpg") in str(cut.value)
