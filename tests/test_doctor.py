"""`autotune doctor`: a copy of examples/dataset with every kind of planted problem (real corrupt, truncated,
16-bit, CMYK, bomb-sized files written to disk), each reported with its severity and file; the clean example;
the engine's own bucket and step counts; JSON, HTML and the CLI as real subprocesses; `autotune run` refusing."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from autotune.cli import main as autotune_main
from autotune.doctor import check_before_training, diagnose, summary_line
from autotune.doctor.images import BOMB_LIMIT_PIXELS
from autotune.doctor.render_html import write_html
from autotune.doctor.render_json import FORMAT, report_dict
from sd_scripts_compat.dataset.train_dataset import build_dataset
from sd_scripts_compat.facts.dataset_spec import DatasetSpec, SubsetSpec
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import get_family

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "dataset"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "120"}
PLANTED = "5_planted thing"
TRIGGER = "planted thing"


def autotune(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autotune", *args], capture_output=True, text=True, timeout=300,
                          env=ENV, check=False)


def _noise(size: tuple[int, int], seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


def _truncated(path: Path, image: Image.Image, fmt: str) -> None:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    data = buffer.getvalue()
    path.write_bytes(data[: len(data) // 2])


def png_claiming(path: Path, width: int, height: int) -> None:
    """A 100-byte PNG whose header claims width x height (IHDR rewritten, CRC fixed): a decompression bomb."""
    buffer = io.BytesIO()
    Image.new("1", (8, 8)).save(buffer, format="PNG")
    data = bytearray(buffer.getvalue())
    assert data[12:16] == b"IHDR"
    data[16:24] = width.to_bytes(4, "big") + height.to_bytes(4, "big")
    data[29:33] = zlib.crc32(bytes(data[12:29])).to_bytes(4, "big")
    path.write_bytes(bytes(data))


def plant_problems(root: Path) -> dict[str, tuple[str, str]]:
    """Copy examples/dataset to ``root`` and plant one problem of each kind; returns file -> (severity, code)."""
    shutil.copytree(EXAMPLES, root)
    d = root / PLANTED
    d.mkdir()
    expected: dict[str, tuple[str, str]] = {}

    def plant(name: str, severity: str, code: str, caption: str | None = f"{TRIGGER}, a test picture", *,
              in_caption: bool = False) -> Path:
        """Write ``name``'s caption; the problem is expected on the image, or on its caption file."""
        expected[f"{PLANTED}/{Path(name).stem + '.txt' if in_caption else name}"] = (severity, code)
        if caption is not None:
            (d / name).with_suffix(".txt").write_text(caption, encoding="utf-8")
        return d / name

    _truncated(plant("truncated.png", "error", "truncated"), _noise((320, 320), 1), "PNG")
    _truncated(plant("truncated.jpg", "error", "truncated"), _noise((320, 320), 2), "JPEG")
    plant("random.png", "error", "unreadable").write_bytes(np.random.default_rng(3).bytes(2000))
    plant("zero.png", "error", "empty-file").write_bytes(b"")
    gradient = np.linspace(0, 65535, 320 * 320).reshape(320, 320).astype(np.uint16)
    Image.fromarray(gradient).save(d / "grey16.png")  # 16-bit: the engine scales it to 8 bits, so no problem
    (d / "grey16.txt").write_text(f"{TRIGGER}, a test picture", encoding="utf-8")
    rgba = np.zeros((320, 320, 4), dtype=np.uint8)
    rgba[:, :160] = (200, 30, 30, 255)  # right half fully transparent over black
    Image.fromarray(rgba).save(plant("alpha.png", "warning", "alpha"))
    _noise((320, 320), 4).convert("P", palette=Image.Palette.ADAPTIVE, colors=16).save(
        plant("palette.png", "warning", "palette"))
    Image.new("CMYK", (320, 320), (0, 200, 200, 0)).save(plant("cmyk.jpg", "warning", "cmyk"))
    _noise((16, 16), 5).save(plant("tiny.png", "error", "too-small"))
    Image.new("1", (20000, 20000)).save(plant("huge.png", "error", "bomb"))  # 400 MP, ~50 KB on disk
    png_claiming(plant("claims.png", "error", "bomb"), 30000, 30000)
    exif = Image.Exif()
    exif[0x0112] = 6
    _noise((400, 320), 6).save(plant("rotated.jpg", "warning", "exif-rotation"), exif=exif)
    _noise((320, 320), 7).save(plant("no_trigger.png", "warning", "trigger-missing", "a picture without the word",
                                     in_caption=True))
    _noise((320, 320), 17).save(d / "dup_a.png")
    (d / "dup_a.txt").write_text(f"{TRIGGER}, the original", encoding="utf-8")
    shutil.copy(d / "dup_a.png", plant("dup_b.png", "warning", "duplicate"))
    _noise((320, 320), 8).save(plant("empty_caption.png", "error", "caption-empty", "", in_caption=True))
    _noise((320, 320), 9).save(plant("long_caption.png", "warning", "caption-too-long", f"{TRIGGER}, " + ", ".join(
        f"tag number {i}" for i in range(25)), in_caption=True))
    _noise((320, 320), 10).save(plant("no_caption.png", "warning", "caption-missing", None))
    _noise((320, 320), 11).save(plant("two_lines.png", "warning", "caption-multiline", f"{TRIGGER}\nmore words",
                                      in_caption=True))
    _noise((320, 320), 12).save(plant("latin1.png", "error", "caption-not-utf8", None, in_caption=True))
    (d / "latin1.txt").write_bytes(f"{TRIGGER}, caf\xe9".encode("latin-1"))
    _noise((320, 320), 18).save(plant("other_ext.png", "warning", "caption-missing", None))
    (d / "other_ext.caption").write_text(f"{TRIGGER}, under the wrong extension", encoding="utf-8")
    expected[f"{PLANTED}/other_ext.caption"] = ("warning", "caption-other-extension")
    (d / "lonely.txt").write_text(f"{TRIGGER}, a caption without its image", encoding="utf-8")
    expected[f"{PLANTED}/lonely.txt"] = ("warning", "caption-orphan")
    _noise((64, 64), 13).save(d / "animation.gif")
    expected[f"{PLANTED}/animation.gif"] = ("warning", "unsupported-format")
    _noise((64, 64), 14).save(d / "scan.tiff")
    expected[f"{PLANTED}/scan.tiff"] = ("warning", "unsupported-format")
    (root / "0_never").mkdir()
    _noise((320, 320), 15).save(root / "0_never" / "a.png")
    expected["0_never"] = ("warning", "folder-skipped")
    (root / "raw photos").mkdir()
    _noise((320, 320), 16).save(root / "raw photos" / "b.png")
    expected["raw photos"] = ("warning", "folder-skipped")
    return expected


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> tuple[Path, dict[str, tuple[str, str]]]:
    root = tmp_path_factory.mktemp("doctor") / "dataset"
    return root, plant_problems(root)


@pytest.fixture(scope="module")
def planted_report(planted):
    return diagnose(planted[0])


def test_every_planted_problem_is_reported_with_its_severity_and_file(planted, planted_report):
    found = {(p.file, p.severity, p.code) for p in planted_report.problems}
    missing = [(file, *what) for file, what in planted[1].items() if (file, *what) not in found]
    assert not missing, "\n".join(f"{p.severity} {p.code} {p.file}: {p.message}" for p in planted_report.problems)
    for problem in planted_report.problems:
        assert problem.message and problem.fix and problem.severity in ("error", "warning")
    assert len(planted_report.errors) >= 9 and not planted_report.ok


def test_planted_messages_say_what_the_engine_does(planted_report):
    by = {(p.file.split("/")[-1], p.code): p for p in planted_report.problems}
    assert not [code for file, code in by if file == "grey16.png"]  # the engine's loader scales 16 bits now
    assert "drops the alpha channel" in by[("alpha.png", "alpha")].message
    assert "(0, 0, 0)" in by[("alpha.png", "alpha")].message  # the black stored under the transparent half
    assert "20000 x 20000" in by[("huge.png", "bomb")].message
    assert "30000 x 30000" in by[("claims.png", "bomb")].message
    assert f"{BOMB_LIMIT_PIXELS / 1e6:.1f} MP" in by[("claims.png", "bomb")].message
    assert "dup_a.png" in by[("dup_b.png", "duplicate")].message
    assert "max_token_length = 150" in by[("long_caption.txt", "caption-too-long")].fix
    assert "'planted thing'" in by[("no_trigger.txt", "trigger-missing")].message
    assert "16 x 16" in by[("tiny.png", "too-small")].message


def test_bomb_guard_reads_the_header_only(tmp_path, monkeypatch):
    """Spy on Pillow's decoder (ImageFile.load): the doctor never calls it for a file over the limit."""
    from PIL import ImageFile

    (tmp_path / "1_x").mkdir()
    png_claiming(tmp_path / "1_x" / "claims.png", 30000, 30000)
    Image.new("1", (20000, 20000)).save(tmp_path / "1_x" / "huge.png")
    decoded: list[str] = []
    real_load = ImageFile.ImageFile.load

    def spy(self):
        decoded.append(str(getattr(self, "filename", "")))
        return real_load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", spy)
    report = diagnose(tmp_path, count_tokens=lambda captions: [0] * len(captions))
    assert {(p.file, p.code) for p in report.errors} == {("1_x/claims.png", "bomb"), ("1_x/huge.png", "bomb")}
    assert not [name for name in decoded if "claims" in name or "huge" in name]
    assert report.steps_per_epoch == 0 and report.subsets[0].usable_images == 0


def test_planted_subset_facts(planted_report):
    facts = {s.folder: s for s in planted_report.subsets}
    assert set(facts) == {"10_circle shape", "10_square shape", "10_triangle shape", PLANTED}
    p = facts[PLANTED]
    assert (p.num_repeats, p.class_tokens) == (5, TRIGGER)
    assert (p.captions_missing, p.captions_orphaned, p.captions_empty) == (2, 1, 1)  # no_caption + other_ext
    assert p.images == 21 and p.usable_images == 14  # 7 images with errors (the 6 broken files, tiny.png)
    modes = dict(p.modes)
    assert (modes["1"], modes["I;16"], modes["CMYK"], modes["P"], modes["unknown"]) == (2, 1, 1, 1, 2)  # bombs 1
    assert p.top_tags[0] == (TRIGGER, 18)  # 16 captions start with it, 2 images fall back to the class tokens


def test_example_dataset_has_no_errors_and_matches_the_engine():
    """examples/dataset (192-320 px images): no errors, only 'small' warnings for the images whose bucket side
    falls under the 256 px smallest bucket, at 512 px and at the tiny family's native 256 px; buckets and steps
    per epoch equal what the engine's TrainDataset builds."""
    report = diagnose(EXAMPLES)
    assert report.ok and {p.code for p in report.warnings} <= {"small"}
    for batch in (1, 3, 4):
        tiny = diagnose(EXAMPLES, family=get_family("tiny-sd15"), batch=batch)
        assert tiny.ok and all(p.code in ("bucket-under-batch", "small") for p in tiny.problems)
        s = tiny.settings
        spec = DatasetSpec(subsets=tuple(SubsetSpec(image_dir=str(EXAMPLES / f.folder), num_repeats=f.num_repeats,
                                                    class_tokens=f.class_tokens, caption_extension=".txt")
                                         for f in tiny.subsets),
                           resolution=(s.resolution, s.resolution), batch_size=batch, enable_bucket=True,
                           min_bucket_reso=s.min_bucket_reso, max_bucket_reso=s.max_bucket_reso,
                           bucket_reso_steps=s.bucket_reso_steps, bucket_no_upscale=True)
        engine = build_dataset(spec, seed=0)
        assert tiny.steps_per_epoch == engine.num_batches() == len(engine.batches_for_epoch(0))
        assert {(r.width, r.height): r.views for r in tiny.buckets} == engine.bucket_counts()
    at_native = diagnose(EXAMPLES, family=get_family("tiny-sd15"))
    assert at_native.ok and {p.code for p in at_native.problems} <= {"small"}


def test_bucket_smaller_than_batch_names_each_image(tmp_path):
    """One wide image among squares, 3 repeats, batch 4: its bucket never fills a batch (short batch of 3)."""
    folder = tmp_path / "3_thing"
    folder.mkdir()
    for i in range(4):
        _noise((512, 512), i).save(folder / f"sq{i}.png")
        (folder / f"sq{i}.txt").write_text("thing, square", encoding="utf-8")
    _noise((1024, 384), 9).save(folder / "wide.png")
    (folder / "wide.txt").write_text("thing, wide", encoding="utf-8")
    report = diagnose(tmp_path, batch=4)
    under = [p for p in report.problems if p.code == "bucket-under-batch"]
    assert [p.file for p in under] == ["3_thing/wide.png"] and "short batch of 3" in under[0].message
    assert report.steps_per_epoch == 3 + 1  # 12 square views in 3 batches of 4, the wide one in one batch of 3
    assert [(r.views, r.batches, r.last_batch) for r in report.buckets if r.images == 1] == [(3, 1, 3)]


def test_json_is_one_stable_object(planted):
    done = autotune("doctor", str(planted[0]), "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["format"] == FORMAT and data["ok"] is False
    assert set(data) == {"format", "dataset", "ok", "summary", "settings", "subsets", "buckets", "problems"}
    assert set(data["problems"][0]) == {"severity", "code", "file", "message", "fix"}
    assert data["problems"][0]["severity"] == "error"  # errors first
    assert data["summary"]["errors"] == sum(p["severity"] == "error" for p in data["problems"])
    assert data["settings"]["resolution"] == 512 and data["settings"]["bomb_limit_pixels"] == BOMB_LIMIT_PIXELS
    assert set(data["subsets"][0]["captions"]) == {"found", "missing", "orphaned", "empty"}
    assert data == json.loads(json.dumps(report_dict(diagnose(planted[0]))))  # the CLI prints exactly the report


def test_strict_exit_codes_and_terminal_output(planted):
    plain = autotune("doctor", str(planted[0]))
    assert plain.returncode == 0, plain.stderr
    assert "truncated" in plain.stdout and "5_planted thing/huge.png" in plain.stdout
    assert "fix the errors before training" in plain.stdout and "steps per epoch" in plain.stdout
    assert autotune("doctor", str(planted[0]), "--strict").returncode == 1
    clean = autotune("doctor", str(EXAMPLES), "--model", "builtin:tiny-sd15", "--strict")
    assert clean.returncode == 0 and "ready to train" in clean.stdout


def test_bad_input_is_one_line_exit_2(tmp_path):
    for args, words in (([str(tmp_path / "nope")], "not found"), ([str(EXAMPLES), "--batch", "0"], "--batch")):
        done = autotune("doctor", *args)
        assert done.returncode == 2, done.stderr
        line = done.stderr.strip()
        assert line.count("\n") == 0 and line.startswith("autotune doctor: error:") and words in line
    # an extension without its dot is read as sd-scripts reads it ("txt" -> ".txt"), not refused
    done = autotune("doctor", str(EXAMPLES), "--caption-extension", "txt")
    assert done.returncode == 0 and "12 of 12 images captioned (.txt)" in done.stdout


def test_html_report_is_self_contained(planted, tmp_path):
    page_path = write_html(diagnose(planted[0]), tmp_path / "report.html")
    page = page_path.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page and "</html>" in page
    assert not re.search(r"(src|href)=\"(?!data:)", page) and "http://" not in page and "https://" not in page
    thumbnails = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(thumbnails) >= 8
    assert all(base64.b64decode(t).startswith(b"\x89PNG") for t in thumbnails)
    assert 'alt="5_planted thing/grey16.png"' not in page  # a 16-bit image is no problem (the engine scales it)
    assert "huge.png" in page and 'alt="5_planted thing/huge.png"' not in page  # a bomb is never decoded
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]  # written atomically, no temp file left
    done = autotune("doctor", str(EXAMPLES), "--html", str(tmp_path / "cli.html"))
    assert done.returncode == 0 and (tmp_path / "cli.html").is_file() and "HTML report:" in done.stdout


def test_run_refuses_a_dataset_with_errors(tmp_path, capsys):
    """`autotune run` checks first: one line naming the file and pointing at `autotune doctor`, nothing written."""
    folder = tmp_path / "data" / "2_toy"
    folder.mkdir(parents=True)
    for i in range(2):
        _noise((64, 64), i).save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text("toy, a picture", encoding="utf-8")
    (folder / "img1.txt").write_text("", encoding="utf-8")
    code = autotune_main(["run", str(tmp_path / "data"), "--model", "builtin:tiny-sd15", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0, err
    assert "img1.txt" in err and "autotune doctor" in err and "--skip-doctor" in err
    assert not (tmp_path / "o").exists()
    (folder / "img1.txt").write_text("toy, another picture", encoding="utf-8")
    lines = check_before_training(tmp_path / "data", family=get_family("tiny-sd15"))
    assert lines[0] == summary_line(diagnose(tmp_path / "data", family=get_family("tiny-sd15")))
    assert "0 errors" in lines[0]


def test_check_before_training_raises_user_error(planted):
    with pytest.raises(UserError, match="autotune doctor"):
        check_before_training(planted[0], family=None)  # no family told: full-size rules


def test_a_small_bucket_names_its_real_cause():
    """320 x 256 is not small, nor extreme: at 256 px its same-area bucket in 64 px steps is 256 x 192, so the
    warning names the aspect ratio and offers the two real fixes; a 288 x 224 image is small (no upscale)."""
    report = diagnose(EXAMPLES, family=get_family("tiny-sd15"))
    by_file = {Path(p.file).name: p for p in report.problems if p.code == "small"}
    elongated, small = by_file["triangle_00.png"], by_file["square_03.jpg"]
    assert "aspect ratio 1.25" in elongated.message and "min_bucket_reso = 192" in elongated.fix
    assert "bucket_no_upscale keeps small images small" in small.message and "256 px" in small.fix
