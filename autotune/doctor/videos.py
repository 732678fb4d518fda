"""Checks on one video of a clip dataset (Wan in musubi-tuner): readable, its frame count, rate and duration, and
whether it holds the planned clip. Read with PyAV, musubi-tuner's own reader (``dataset/media_utils.load_video``
decodes every frame with ``av``), so a file that fails here fails there; PyAV is imported only for a video dataset.

musubi-tuner's ``frame_extraction = "head"`` (what ``autotune plan`` writes) takes the first ``target_frames`` of
each video and makes no sample at all of a shorter one: the dataset shrinks without a word, so the doctor makes
that an error naming the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from autotune.doctor.images import ImageCheck
from autotune.doctor.report import ERROR, Problem
from sd_scripts_compat.facts.errors import UserError

REENCODE = "re-encode it (e.g. ffmpeg -i IN -c:v libx264 -pix_fmt yuv420p OUT.mp4) or remove it"


@dataclass(frozen=True)
class VideoFacts:
    frames: int
    fps: float
    size: tuple[int, int]

    @property
    def seconds(self) -> float:
        return self.frames / self.fps if self.fps else 0.0


def read_video(path: Path) -> VideoFacts | str:
    """Every frame decoded (as musubi-tuner does): the facts, or why it cannot be read."""
    try:
        import av
    except ImportError:
        raise UserError(f"{path}: checking videos needs PyAV, the reader musubi-tuner uses; pip install av") from None
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                return "it holds no video stream"
            stream = container.streams.video[0]
            frames, size = 0, None
            for frame in container.decode(stream):
                frames, size = frames + 1, size or (frame.width, frame.height)
            rate = float(stream.average_rate or stream.base_rate or 0)
    except (av.FFmpegError, OSError, ValueError) as error:
        return f"it cannot be decoded ({error.__class__.__name__}: {str(error).splitlines()[0][:120]})"
    if not frames or size is None:
        return "it holds no decodable frame"
    return VideoFacts(frames=frames, fps=rate, size=size)


def check_video(path: Path, rel: str, clip_frames: int, stride: int = 4) -> tuple[ImageCheck, VideoFacts | None]:
    """One video as the doctor's per-file check (its frame size as the bucket size) and its facts."""
    length = path.stat().st_size
    if length == 0:
        return ImageCheck(path, None, None, (Problem(ERROR, "empty-file", rel, "the file is empty (0 bytes); "
                                                     "musubi-tuner stops when it reaches it", REENCODE),)), None
    facts = read_video(path)
    if isinstance(facts, str):
        return ImageCheck(path, None, None, (Problem(ERROR, "video-unreadable", rel, facts, REENCODE),),
                          length), None
    problems: tuple[Problem, ...] = ()
    if facts.frames < clip_frames:
        fewer = 1 + (facts.frames - 1) // stride * stride
        problems = (Problem(ERROR, "video-too-short", rel,
                            f"{facts.frames} frames ({facts.seconds:.1f} s at {facts.fps:g} fps): shorter than the "
                            f"planned clip of {clip_frames}, so musubi-tuner's frame_extraction \"head\" makes no "
                            "sample of it",
                            f"use a longer clip, or plan clips of {fewer} frames (--frames {fewer})"),)
    return ImageCheck(path, facts.size, f"{facts.frames} frames", problems, length), facts  # the frame histogram


def clip_summary(facts: list[VideoFacts]) -> str:
    """One folder's videos in a line: how many, their frame counts and their length in all."""
    if not facts:
        return "no readable videos"
    counts = sorted(f.frames for f in facts)
    span = f"{counts[0]}" if counts[0] == counts[-1] else f"{counts[0]}-{counts[-1]}"
    return f"{len(facts)} videos of {span} frames, {sum(f.seconds for f in facts):.1f} s in all"
