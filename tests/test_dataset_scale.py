"""Every step that reads a dataset reads it in linear time: folder listings and file opens are counted (not timed)
for the scan, `autotune plan`, the doctor (full and --quick) and the engine's loader start, at 500 and 2,000
images; neither count may grow faster than the dataset. Plus the hostile shapes of a large dataset: a folder of
100,000 entries that are mostly not images, and 10,000 N_name subfolders. Timings are bench/dataset_scale.py's.
"""

from __future__ import annotations

import builtins
import io
import os
import random
import threading
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

from sd_scripts_compat.facts.families import get_family

SIZES = ((64, 64), (64, 96), (96, 64), (80, 64), (64, 112))


def make_dataset(root: Path, count: int, folders: int = 2) -> Path:
    """``count`` small PNGs with captions in ``folders`` N_name folders; a few uncaptioned, one with a .TXT."""
    rng = random.Random(count)
    for index in range(count):
        folder = root / f"5_style{index % folders}"
        folder.mkdir(parents=True, exist_ok=True)
        image = Image.new("RGB", SIZES[index % len(SIZES)], tuple(rng.randrange(256) for _ in range(3)))
        image.putpixel((index % 64, 0), (index % 256, index // 256 % 256, 7))
        image.save(folder / f"img{index:05d}.png", compress_level=1)
        if index % 50 == 7:
            (folder / f"img{index:05d}.TXT").write_text("style, upper case suffix")  # read by nobody: "elsewhere"
        elif index % 50 != 3:
            (folder / f"img{index:05d}.txt").write_text(f"style{index % folders}, tag{index % 17}")
    return root


class Reads:
    """Folder listings, the entries they yield, and file opens in this process, while it is patched in
    (``os.scandir`` / ``os.listdir`` / ``Path.iterdir``; ``open``, which Pillow, pathlib and the hashing go through,
    and safetensors' ``safe_open`` / ``load_file``, which open in Rust: the caches' entries).
    Entries catch a listing repeated per image even when the number of listings looks fine."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, under: Path) -> None:
        self.counts: Counter[str] = Counter()
        self.opened: Counter[Path] = Counter()  # which files were opened, how often
        self.under = str(under)
        scandir, listdir, iterdir = os.scandir, os.listdir, Path.iterdir
        monkeypatch.setattr(os, "scandir", lambda path=".": _Entries(self, path, scandir(path)))
        monkeypatch.setattr(os, "listdir", lambda path=".": self._listed(path, listdir(path)))
        monkeypatch.setattr(Path, "iterdir", lambda path: _Entries(self, path, iterdir(path)))
        for module in (builtins, io):
            monkeypatch.setattr(module, "open", self._opening(module.open))
        import safetensors
        import safetensors.torch

        for module, name in ((safetensors, "safe_open"), (safetensors.torch, "load_file")):  # opened by Rust
            monkeypatch.setattr(module, name, self._opening(getattr(module, name)))

    def mine(self, target: object) -> bool:
        return isinstance(target, (str, os.PathLike)) and os.fspath(target).startswith(self.under)

    def _listed(self, path: object, names: list[str]) -> list[str]:
        if self.mine(path):
            self.counts["listings"] += 1
            self.counts["entries"] += len(names)
        return names

    def _opening(self, function):  # noqa: ANN001, ANN202 - wraps open, any signature
        def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            target = args[0] if args else kwargs.get("file")
            if self.mine(target):
                self.counts["opens"] += 1
                self.opened[Path(os.fspath(target))] += 1
            return function(*args, **kwargs)
        return counted


class _Entries:
    """A listing's iterator (a context manager too, as ``os.scandir``'s is) counting what it yields."""

    def __init__(self, reads: Reads, path: object, inner) -> None:  # noqa: ANN001
        self.reads, self.inner, self.mine = reads, inner, reads.mine(path)
        if self.mine:
            reads.counts["listings"] += 1

    def __iter__(self) -> _Entries:
        return self

    def __next__(self):  # noqa: ANN204
        entry = next(self.inner)
        if self.mine:
            self.reads.counts["entries"] += 1
        return entry

    def __enter__(self) -> _Entries:
        return self

    def __exit__(self, *exc: object) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()


def _scan(dataset: Path) -> None:
    from autotune.planning.dataset import scan_dataset

    assert scan_dataset(dataset).num_images > 0


def _plan(dataset: Path) -> None:
    from autotune.cli import main

    assert main(["plan", str(dataset), "--model", "builtin:tiny-sd15", "--vram", "8", "--no-learn"]) in (0, None)


def _doctor(dataset: Path, quick: bool = False) -> None:
    from autotune.doctor.diagnose import diagnose

    assert diagnose(dataset, family=get_family("tiny-sd15"), resolution=64, quick=quick).subsets


def _loader(dataset: Path) -> None:
    from sd_scripts_compat.dataset.train_dataset import build_dataset
    from sd_scripts_compat.facts.dataset_spec import DatasetSpec, SubsetSpec

    subsets = tuple(SubsetSpec(str(folder), num_repeats=5, caption_extension=".txt", class_tokens=folder.name[2:])
                    for folder in sorted(dataset.iterdir()))
    spec = DatasetSpec(subsets=subsets, resolution=(64, 64), batch_size=2, enable_bucket=True, min_bucket_reso=32,
                       max_bucket_reso=128, bucket_reso_steps=16)
    assert build_dataset(spec, seed=0).records


STEPS = {"scan": _scan, "plan": _plan, "doctor": _doctor, "doctor --quick": lambda d: _doctor(d, quick=True),
         "loader start": _loader}


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("scale")
    return {count: make_dataset(root / str(count), count) for count in (500, 2000)}


@pytest.mark.parametrize("step", list(STEPS))
def test_listings_and_opens_do_not_grow_faster_than_the_dataset(step, datasets, monkeypatch, capsys, recwarn):
    """Counted in this process (the doctor checks its images here: one worker, so its opens can be counted)."""
    monkeypatch.setattr("autotune.doctor.image_pool.usable_cores", lambda: 1)
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(datasets[500].parent / "cache"))
    per_image = {}
    for count, dataset in datasets.items():
        STEPS[step](dataset)  # once before counting: first-use imports and caches are not the dataset's
        with pytest.MonkeyPatch.context() as patch:
            reads = Reads(patch, dataset)
            STEPS[step](dataset)
        per_image[count] = {kind: reads.counts[kind] / count for kind in ("listings", "entries", "opens")}
    small, large = per_image[500], per_image[2000]
    assert large["listings"] <= small["listings"], (step, per_image)  # per folder, not per image
    assert large["entries"] <= small["entries"] * 1.01, (step, per_image)  # each folder's files read a few times
    # opens per image may wander a little (the duplicate check hashes only files of equal length, and a larger
    # dataset has more such pairs: at most one open per image); anything quadratic adds hundreds per image
    assert large["opens"] <= small["opens"] + 0.25, (step, per_image)
    assert small["listings"] * 500 <= 6, (step, per_image)  # 2 image folders and the root: each read a few times


def test_a_folder_of_100000_entries_mostly_not_images_scans_in_one_listing(tmp_path, monkeypatch):
    """Sidecar files, caches and junk beside 200 images: the scan and the planner's summary list it once each
    and find exactly the images and their captions."""
    from autotune.planning.dataset import scan_dataset

    folder = tmp_path / "10_junk"
    folder.mkdir()
    for index in range(100_000):
        (folder / f"note{index:06d}.json").touch()
    image = Image.new("RGB", (64, 64))
    for index in range(200):
        image.save(folder / f"pic{index:03d}.png")
        (folder / f"pic{index:03d}.txt").write_text("junk")
    reads = Reads(monkeypatch, tmp_path)
    summary = scan_dataset(tmp_path)
    assert (summary.num_images, summary.subsets[0].num_captions) == (200, 200)
    assert reads.counts["listings"] == 2 and reads.counts["opens"] == 0, reads.counts
    assert reads.counts["entries"] == 1 + 100_400, reads.counts  # the root's one folder, then the folder's files


def test_10000_repeat_folders_are_read_once_each(tmp_path, monkeypatch):
    """A dataset of 10,000 N_name folders (one image each, one empty, one hidden, one not N_name): every folder is
    listed once, the odd ones are named, and the doctor's folder problems come from the same listings."""
    from autotune.doctor.folders import scan_problems
    from sd_scripts_compat.facts.dataset_scan import scan_dataset_folder

    image = Image.new("RGB", (8, 8))
    for index in range(10_000):
        folder = tmp_path / f"1_f{index:05d}"
        folder.mkdir()
        if index != 5:
            image.save(folder / "a.png")
    (tmp_path / ".cache").mkdir()
    (tmp_path / "notes").mkdir()
    reads = Reads(monkeypatch, tmp_path)
    scan = scan_dataset_folder(tmp_path)
    problems = scan_problems(scan)
    assert scan.num_images == 9_999 and len(scan.subsets) == 9_999
    assert reads.counts["listings"] == 10_001 and reads.counts["opens"] == 0, reads.counts  # root + 10,000 N_name
    assert sorted(p.file for p in problems) == ["1_f00005", "notes"], problems


def _png_with_exif_after_pixels(path: Path) -> None:
    """A PNG whose eXIf chunk (orientation 6) follows its pixels: PNG allows it, Pillow finds it only on load."""
    import struct

    exif = Image.Exif()
    exif[0x0112] = 6
    Image.new("RGB", (96, 64), (9, 9, 9)).save(path, exif=exif)
    data = path.read_bytes()
    chunks, at = [], 8
    while at < len(data):
        length = struct.unpack(">I", data[at:at + 4])[0]
        chunks.append(data[at:at + 12 + length])
        at += 12 + length
    exif_chunk = next(c for c in chunks if c[4:8] == b"eXIf")
    rest = [c for c in chunks if c is not exif_chunk]
    path.write_bytes(data[:8] + b"".join(rest[:-1]) + exif_chunk + rest[-1])


def test_png_exif_rotation_without_decoding_the_header_and_after_the_pixels(tmp_path):
    """An eXIf chunk before the pixels is read from the header (quick and full); one after them is found by the
    full check's decode, never by decoding twice: Pillow's PNG getexif would load the image just to look."""
    from autotune.doctor.images import check_image

    exif = Image.Exif()
    exif[0x0112] = 6
    before = tmp_path / "before.png"
    Image.new("RGB", (96, 64), (9, 9, 9)).save(before, exif=exif)
    after = tmp_path / "after.png"
    _png_with_exif_after_pixels(after)
    codes = {(path.name, quick): [p.code for p in check_image(path, path.name, quick).problems]
             for path in (before, after) for quick in (True, False)}
    assert codes == {("before.png", True): ["exif-rotation"], ("before.png", False): ["exif-rotation"],
                     ("after.png", True): [], ("after.png", False): ["exif-rotation"]}, codes


def test_images_checked_over_two_workers_equal_those_checked_here(tmp_path):
    """The pool (spawned workers, chunks) gives each image the same check, in the same order, as this process."""
    from autotune.doctor.image_pool import POOL_FROM_IMAGES, check_images

    root = make_dataset(tmp_path / "data", POOL_FROM_IMAGES + 20, folders=1)
    broken = root / "5_style0" / "img00005.png"
    broken.write_bytes(broken.read_bytes()[:-30])
    images = [(path, path.name) for path in sorted((root / "5_style0").glob("*.png"))]
    seen: list[int] = []
    pooled = check_images(images, workers=2, progress=lambda done, total: seen.append(done))
    assert pooled == check_images(images, workers=1)
    assert seen == list(range(1, len(images) + 1))
    assert [p.code for c in pooled for p in c.problems] == ["truncated"]
    from_a_thread: list[object] = []  # as the web app calls it: threads alive, so the workers are spawned
    worker = threading.Thread(target=lambda: from_a_thread.append(check_images(images, workers=2)))
    worker.start()
    worker.join()
    assert from_a_thread == [pooled]


def _cached_dataset(root: Path):  # noqa: ANN202 - a TrainDataset with its latents and text outputs on disk
    from sd_scripts_compat.dataset.train_dataset import build_dataset
    from sd_scripts_compat.facts.dataset_spec import DatasetSpec, SubsetSpec

    subsets = tuple(SubsetSpec(str(folder), num_repeats=1, caption_extension=".txt", class_tokens=folder.name[2:])
                    for folder in sorted(root.iterdir()))
    return build_dataset(DatasetSpec(subsets=subsets, resolution=(64, 64), batch_size=1, enable_bucket=True,
                                     min_bucket_reso=32, max_bucket_reso=128, bucket_reso_steps=16), seed=0)


def test_the_caches_lookups_read_each_entry_once(tmp_path):
    """The latent and text-encoder caches on disk, looked up again (every entry there): listings and opens per image
    do not grow from 300 to 1,200 images."""
    import torch

    from sd_scripts_compat.caching.latent_cache import cache_latents
    from sd_scripts_compat.caching.text_cache import cache_text_encoder_outputs
    from sd_scripts_compat.runtimes import load_base_model

    bundle = load_base_model("builtin:tiny-sd15")
    per_image = {}
    for count in (300, 1200):
        root = make_dataset(tmp_path / str(count), count)
        for _ in range(2):  # the first pass writes every entry; the second only looks them up
            dataset = _cached_dataset(root)
            with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
                reads = Reads(patch, root)
                latents = cache_latents(dataset, bundle.vae, to_disk=True, vae_batch_size=16)
                texts = cache_text_encoder_outputs(dataset, bundle, to_disk=True, batch_size=16)
        assert latents.encoded == 0 and texts.encoded == 0, (latents, texts)
        per_image[count] = {kind: reads.counts[kind] / count for kind in ("listings", "entries", "opens")}
    small, large = per_image[300], per_image[1200]
    assert large["listings"] <= small["listings"] and large["entries"] <= small["entries"] * 1.01, per_image
    assert large["opens"] <= small["opens"] + 0.25, per_image


def test_the_folder_browser_and_the_organise_step_list_a_flat_folder_once(tmp_path, monkeypatch):
    """A flat folder of 2,000 images with captions: the web app's folder browser and the wizard's organise step
    each list it once and open nothing (no stat per entry either: their listing says what each entry is)."""
    from autotune.ui.api import browse_folder
    from autotune.ui.security import AccessPolicy
    from autotune.wizard.organise import plan_layout

    flat = make_dataset(tmp_path / "data", 2000, folders=1) / "5_style0"
    (flat / "sub").mkdir()
    (flat / "model.safetensors").touch()
    stats = Counter()
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda path, *a, **k: (stats.update([os.fspath(path).startswith(str(flat))]),
                                                            real_stat(path, *a, **k))[1])
    with pytest.MonkeyPatch.context() as patch:
        reads = Reads(patch, flat)
        listed = browse_folder(AccessPolicy("127.0.0.1", 0, None, (tmp_path,)), str(flat))
        layout = plan_layout(flat, tmp_path / "out", 5, "style", "link")
    assert listed["folders"] == ["sub"] and listed["files"] == ["model.safetensors"]
    assert len(layout.files) == 2000 + 1960  # the images and their captions (1 in 50 has none; .TXT counts)
    assert reads.counts["listings"] == 2 and reads.counts["opens"] == 0, reads.counts
    assert stats[True] <= 4, stats  # the folder itself, not its entries
