"""A clip dataset for a video family (Wan in musubi-tuner): real MP4 files written with PyAV (musubi-tuner's own
reader), scanned the way musubi globs them, checked by the doctor (frame counts, lengths, unreadable and too-short
videos, each named) and planned into musubi's video dataset TOML."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import toml

av = pytest.importorskip("av")

WAN = "builtin:wan2.1-t2v-1.3b"


def write_clip(path: Path, frames: int, fps: int = 16, side: int = 64) -> None:
    import numpy as np

    rng = np.random.default_rng(frames)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width = stream.height = side
        stream.pix_fmt = "yuv420p"
        for _ in range(frames):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())


@pytest.fixture
def clips(tmp_path: Path) -> Path:
    folder = tmp_path / "clips" / "5_walk"
    folder.mkdir(parents=True)
    write_clip(folder / "long.mp4", 40)
    write_clip(folder / "short.mp4", 20)
    (folder / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not really a video")
    (folder / "empty.webm").write_bytes(b"")
    write_clip(folder / "mixed.Mp4", 40)  # musubi globs .mp4 and .MP4 only: never read
    for name in ("long", "short", "broken", "empty"):
        (folder / f"{name}.txt").write_text("a person walking\n")
    return tmp_path / "clips"


def doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "autotune", "doctor", *args], capture_output=True, text=True,
                          timeout=300)


def test_doctor_reports_frame_counts_and_names_every_video_that_would_not_train(clips: Path) -> None:
    result = doctor(str(clips), "--model", WAN, "--frames", "33", "--json")
    report = json.loads(result.stdout)
    problems = {(p["file"], p["code"]) for p in report["problems"]}
    assert ("5_walk/short.mp4", "video-too-short") in problems
    assert ("5_walk/broken.mp4", "video-unreadable") in problems and ("5_walk/empty.webm", "empty-file") in problems
    assert not any(p["file"] == "5_walk/long.mp4" and p["severity"] == "error" for p in report["problems"])
    short = next(p for p in report["problems"] if p["code"] == "video-too-short")
    assert "20 frames (1.2 s at 16 fps)" in short["message"] and "--frames 17" in short["fix"]
    (subset,) = report["subsets"]
    assert subset["images"] == 4 and subset["usable_images"] == 1  # mixed.Mp4 is not listed, as in musubi
    assert subset["modes"] == {"40 frames": 1, "20 frames": 1, "unknown": 2}
    assert subset["clips"] == "2 videos of 20-40 frames, 3.8 s in all"
    assert report["settings"]["frames"] == 33 and not report["ok"]
    text = doctor(str(clips), "--model", WAN, "--frames", "33").stdout
    assert "videos 5_walk: 2 videos of 20-40 frames" in text


def test_a_clip_plan_of_a_video_folder_writes_musubis_video_dataset(clips: Path, tmp_path: Path) -> None:
    out = tmp_path / "plan"
    result = subprocess.run([sys.executable, "-m", "autotune", "plan", str(clips), "--model", WAN, "--frames", "33",
                             "--vram", "16", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    (entry,) = toml.load(out / "dataset.toml")["datasets"]
    assert entry["video_directory"] == str(clips / "5_walk") and entry["target_frames"] == [33]
    assert entry["num_repeats"] == 5 and entry["frame_extraction"] == "head"
    assert json.loads((out / "autotune_plan.json").read_text())["settings"]["frames"] == 33
    assert f"dataset {clips}: 4 videos in 1 folder" in result.stdout


@pytest.mark.parametrize("args, expected", [
    (("--frames", "33"), "--frames 33: clips are for a video family"),
    (("--model", WAN, "--frames", "30"), "--frames 30"),
])
def test_doctor_refuses_frames_it_cannot_check_in_one_line(clips: Path, args: tuple[str, ...], expected: str) -> None:
    result = doctor(str(clips), *args)
    assert result.returncode != 0 and expected in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_the_wizard_asks_a_video_family_for_its_clip_and_checks_the_videos(clips: Path, tmp_path: Path) -> None:
    """`autotune wizard` with a Wan model: the clip length is its question (--frames), the folder is read as
    videos, the doctor names the video that is too short, and the dataset TOML holds the clip."""
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "autotune", "wizard", str(clips), "--model", WAN, "--gpu", "RTX 4090",
                           "--frames", "33", "--yes", "--no-start", "--out", str(out)], capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "400"})
    assert done.returncode == 0, done.stderr
    assert "Frames per clip" in done.stdout and "33 (from --frames)" in done.stdout
    assert "4 videos, 20 clip-views per epoch" in done.stdout
    doctor = next(line for line in done.stdout.splitlines() if "doctor: " in line)  # its first error, in one line
    assert "5_walk/" in doctor and "(and 2 more)" in doctor  # short.mp4, broken.mp4 and empty.webm
    (entry,) = toml.load(out / "dataset.toml")["datasets"]
    assert entry["video_directory"] == str(clips / "5_walk") and entry["target_frames"] == [33]
    refused = subprocess.run([sys.executable, "-m", "autotune", "wizard", str(clips), "--model", "builtin:tiny-sd15",
                              "--cpu", "--frames", "33", "--yes", "--no-start", "--out", str(tmp_path / "no")],
                             capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert refused.returncode != 0 and "--frames 33: tiny-sd15 trains on images" in refused.stderr
    assert not (tmp_path / "no").exists()
