"""The doctor's file cache: a second `autotune doctor` reads no image it has checked, unchanged; a changed file is
checked again; the cache lives in the user cache folder, never in the dataset; a broken cache is passed over."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image
from test_dataset_scale import Reads, make_dataset

from sd_scripts_compat.facts.families import get_family


def _doctor(dataset: Path, quick: bool = False):  # noqa: ANN202 - a DoctorReport
    from autotune.doctor.diagnose import diagnose

    return diagnose(dataset, family=get_family("tiny-sd15"), resolution=128, quick=quick)


def _image_opens(reads: Reads) -> int:
    return sum(n for path, n in reads.opened.items() if path.suffix == ".png")


@pytest.fixture
def dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("autotune.doctor.image_pool.usable_cores", lambda: 1)  # checked here, so opens are seen
    root = make_dataset(tmp_path / "data", 60)
    Image.new("RGB", (64, 64), (1, 2, 3)).save(root / "5_style0" / "copy_a.png")
    Image.new("RGB", (64, 64), (1, 2, 3)).save(root / "5_style0" / "copy_b.png")  # an exact duplicate
    return root


def test_a_second_doctor_reads_no_image_and_reports_the_same(dataset, tmp_path):
    first = _doctor(dataset)
    before = sorted(p.relative_to(dataset) for p in dataset.rglob("*"))
    with pytest.MonkeyPatch.context() as patch:
        reads = Reads(patch, dataset)
        second = _doctor(dataset)
        quick = _doctor(dataset, quick=True)  # a full check serves a quick one too
    assert _image_opens(reads) == 0 and not reads.opened, reads.opened.most_common(3)  # nor a caption
    assert second == first
    assert [p for p in quick.problems] == [p for p in first.problems]
    assert any(p.code == "duplicate" for p in second.problems)
    assert sorted(p.relative_to(dataset) for p in dataset.rglob("*")) == before  # nothing written in the dataset
    assert (tmp_path / "cache" / "file_facts.sqlite").is_file()


def test_a_changed_file_is_checked_again(dataset):
    assert _doctor(dataset).ok
    broken = dataset / "5_style1" / "img00001.png"
    data = broken.read_bytes()
    broken.write_bytes(data[: len(data) // 2])  # truncated: another length and another time
    caption = dataset / "5_style0" / "img00010.txt"
    caption.write_text("style0, first\nsecond line")
    with pytest.MonkeyPatch.context() as patch:
        reads = Reads(patch, dataset)
        report = _doctor(dataset)
    assert [(p.code, p.file) for p in report.errors] == [("truncated", "5_style1/img00001.png")]
    assert ("caption-multiline", "5_style0/img00010.txt") in [(p.code, p.file) for p in report.problems]
    assert {path.name for path in reads.opened} == {"img00001.png", "img00010.txt"}


def test_a_quick_check_does_not_serve_a_full_one(dataset):
    broken = dataset / "5_style0" / "img00002.png"
    broken.write_bytes(broken.read_bytes()[:-30])  # the header reads; the pixels do not
    assert _doctor(dataset, quick=True).ok
    assert [p.code for p in _doctor(dataset).errors] == ["truncated"]


def test_a_broken_cache_is_passed_over_with_one_warning(dataset, tmp_path):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "file_facts.sqlite").write_bytes(b"not a database" * 100)
    with pytest.warns(UserWarning, match="file cache"):
        report = _doctor(dataset)
    assert report.ok and len(report.problems) == len(_doctor_without_cache(dataset).problems)


def _doctor_without_cache(dataset: Path):  # noqa: ANN202
    from autotune.doctor.file_facts import FileFacts

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FileFacts, "open", classmethod(lambda cls, folder=None: cls(None)))
        return _doctor(dataset)


def test_the_cli_doctor_twice_reads_the_cache_and_says_nothing_of_it(dataset, tmp_path):
    """In a real process: the second run's report equals the first's, and stderr stays empty both times."""
    command = [sys.executable, "-m", "autotune", "doctor", str(dataset), "--model", "builtin:tiny-sd15",
               "--resolution", "128", "--json"]
    env = {**os.environ, "AUTOTUNE_CACHE_DIR": str(tmp_path / "cache")}
    runs = [subprocess.run(command, capture_output=True, text=True, env=env, check=True) for _ in range(2)]
    assert runs[0].stdout == runs[1].stdout and not runs[0].stderr and not runs[1].stderr
    with sqlite3.connect(tmp_path / "cache" / "file_facts.sqlite") as db:
        kinds = dict(db.execute("SELECT kind, count(*) FROM facts GROUP BY kind").fetchall())
    assert kinds[next(k for k in kinds if k.endswith("/full"))] == 62 and kinds["sha256"] >= 2, kinds



def test_a_file_in_error_is_checked_again_each_time(dataset):
    """An image the engine would stop at is never kept: a file mended without a change to its length or time (a
    permission fixed with chmod, a copy restored with its times) would otherwise keep its error."""
    image = dataset / "5_style0" / "img00004.png"
    good, times = image.read_bytes(), os.stat(image)
    bad = bytearray(good)
    bad[-40:-12] = bytes(28)  # the same length: the last pixel data zeroed, so the decode or the CRC fails
    image.write_bytes(bytes(bad))
    os.utime(image, ns=(times.st_atime_ns, times.st_mtime_ns))
    assert [p.file for p in _doctor(dataset).errors] == ["5_style0/img00004.png"]
    image.write_bytes(good)
    os.utime(image, ns=(times.st_atime_ns, times.st_mtime_ns))  # mended, same length, same time
    assert _doctor(dataset).ok


def test_the_cli_with_a_broken_cache_says_so_in_one_line_and_checks_everything(dataset, tmp_path):
    """A cache file that is not a database: the doctor's stderr is one line (no Python warning, no traceback), its
    report the one it gives without a cache, and it exits 0."""
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "file_facts.sqlite").write_bytes(b"not a database" * 100)
    command = [sys.executable, "-m", "autotune", "doctor", str(dataset), "--model", "builtin:tiny-sd15",
               "--resolution", "128", "--json"]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ,
                            "AUTOTUNE_CACHE_DIR": str(tmp_path / "cache")})
    assert result.returncode == 0
    assert result.stderr.splitlines() == [result.stderr.strip()] and result.stderr.startswith(
        "autotune doctor: warning: ") and "file cache cannot be used" in result.stderr, result.stderr
