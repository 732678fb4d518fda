"""Generate ``examples/dataset/``: a tiny, real, captioned dataset in kohya's ``N_name`` folder convention.

Twelve small images (192-320 px, several aspect ratios, PNG and JPEG) of three kinds of shape drawn with Pillow,
each with a caption ``.txt``:

    examples/dataset/10_circle shape/circle_00.png + circle_00.txt
    examples/dataset/10_square shape/...
    examples/dataset/10_triangle shape/...

Why drawn instead of downloaded: nothing may come from the network, the files stay small enough to commit
(< 300 KB), and the shapes differ enough that a LoRA trained on them shows a visible effect. Seeded: the same
seed and Pillow version give the same bytes.

    python examples/make_dataset.py [--out examples/dataset] [--seed 1234] [--per-kind 4]
"""

from __future__ import annotations

import argparse
import io
import math
import os
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

REPEATS = 10
# Around the tiny models' native 256 px (the area of 256x256, a few over it): with bucket_no_upscale and
# kohya's 64 px steps each image fills a bucket of nearly that area instead of falling into a small one.
# Eight sizes, as before, so the seeded choices (and so the captions) stay the same.
SIZES = [(256, 256), (320, 192), (192, 320), (288, 224), (224, 288), (320, 256), (256, 320), (288, 288)]
BACKGROUNDS = {
    "white": (246, 246, 242), "light gray": (214, 214, 214), "pale yellow": (246, 236, 190),
    "pale blue": (200, 220, 244), "pale pink": (244, 214, 220), "beige": (232, 218, 196),
}
KINDS = {
    # kind: (colour word, base RGB)
    "circle": ("red", (205, 40, 40)),
    "square": ("blue", (40, 70, 200)),
    "triangle": ("green", (40, 160, 60)),
}
SUPERSAMPLE = 3  # draw large, then downscale: smooth edges without a hand-written anti-aliaser


@dataclass(frozen=True)
class Sample:
    """One image to draw, with everything its caption says."""

    kind: str
    index: int
    size: tuple[int, int]
    background: str
    scale: float  # shape size as a fraction of the shorter side
    offset: tuple[float, float]  # centre offset as a fraction of the free room, -1..1
    angle: float  # degrees; squares and triangles only
    image_format: str  # "png" | "jpg"

    @property
    def stem(self) -> str:
        return f"{self.kind}_{self.index:02d}"


def plan_samples(seed: int, per_kind: int) -> list[Sample]:
    """Decide every image's parameters from one seeded RNG, so the dataset is reproducible."""
    rng = random.Random(seed)
    samples = []
    for kind in KINDS:
        for index in range(per_kind):
            samples.append(Sample(
                kind=kind,
                index=index,
                size=rng.choice(SIZES),
                background=rng.choice(sorted(BACKGROUNDS)),
                scale=rng.uniform(0.4, 0.8),
                offset=(rng.uniform(-1, 1), rng.uniform(-1, 1)),
                angle=rng.uniform(-30, 30) if kind != "circle" else 0.0,
                image_format="png" if index % 2 == 0 else "jpg",
            ))
    return samples


def _shade(rgb: tuple[int, int, int], rng: random.Random) -> tuple[int, int, int]:
    return tuple(max(0, min(255, channel + rng.randint(-25, 25))) for channel in rgb)


def draw(sample: Sample, seed: int) -> Image.Image:
    """Render one sample: a vertical background gradient and one shape, supersampled then downscaled."""
    rng = random.Random(f"{seed}-{sample.stem}")
    width, height = sample.size
    big_w, big_h = width * SUPERSAMPLE, height * SUPERSAMPLE
    top = BACKGROUNDS[sample.background]
    bottom = tuple(max(0, channel - 18) for channel in top)
    gradient = Image.linear_gradient("L").resize((big_w, big_h))
    image = Image.composite(Image.new("RGB", (big_w, big_h), bottom), Image.new("RGB", (big_w, big_h), top),
                            gradient)
    pen = ImageDraw.Draw(image)
    side = sample.scale * min(big_w, big_h)
    corners = {"circle": 0, "square": 4, "triangle": 3}[sample.kind]
    # distance from the centre to the farthest point of the shape: the room it needs, so nothing is cut off
    reach = side / 2 if corners == 0 else min(side / 2 * (math.sqrt(2) if corners == 4 else 1.15),
                                              min(big_w, big_h) / 2)
    cx = big_w / 2 + sample.offset[0] * (big_w / 2 - reach)
    cy = big_h / 2 + sample.offset[1] * (big_h / 2 - reach)
    colour = _shade(KINDS[sample.kind][1], rng)
    outline = tuple(channel // 2 for channel in colour)
    if corners == 0:
        pen.ellipse([cx - reach, cy - reach, cx + reach, cy + reach], fill=colour, outline=outline,
                    width=SUPERSAMPLE * 2)
    else:
        start = math.radians(sample.angle + (45 if corners == 4 else -90))
        points = [(cx + reach * math.cos(start + 2 * math.pi * k / corners),
                   cy + reach * math.sin(start + 2 * math.pi * k / corners)) for k in range(corners)]
        pen.polygon(points, fill=colour, outline=outline, width=SUPERSAMPLE * 2)
    return image.resize((width, height), Image.Resampling.LANCZOS)


def caption(sample: Sample) -> str:
    """What is in the picture, in the words a user would caption it with."""
    colour = KINDS[sample.kind][0]
    size = "large" if sample.scale > 0.65 else ("small" if sample.scale < 0.5 else "medium")
    horizontal = "left" if sample.offset[0] < -0.33 else ("right" if sample.offset[0] > 0.33 else "")
    vertical = "top" if sample.offset[1] < -0.33 else ("bottom" if sample.offset[1] > 0.33 else "")
    place = f"{vertical} {horizontal}".strip() or "center"
    tilt = ", tilted" if abs(sample.angle) > 10 else ""
    return f"{sample.kind} shape, a {size} {colour} {sample.kind}{tilt} at the {place}, {sample.background} background"


def write_atomic(path: Path, data: bytes) -> None:
    """Temp file in the same folder, then os.replace: a reader never sees half a file."""
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def encode(image: Image.Image, image_format: str) -> bytes:
    buffer = io.BytesIO()
    if image_format == "png":
        image.save(buffer, format="PNG", optimize=True)
    else:
        image.save(buffer, format="JPEG", quality=88)
    return buffer.getvalue()


def make_dataset(out: Path, seed: int = 1234, per_kind: int = 4) -> list[Path]:
    """Write the dataset under ``out``; returns the image paths written."""
    written = []
    for sample in plan_samples(seed, per_kind):
        folder = out / f"{REPEATS}_{sample.kind} shape"
        folder.mkdir(parents=True, exist_ok=True)
        image_path = folder / f"{sample.stem}.{sample.image_format}"
        write_atomic(image_path, encode(draw(sample, seed), sample.image_format))
        write_atomic(folder / f"{sample.stem}.txt", (caption(sample) + "\n").encode())
        written.append(image_path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "dataset")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--per-kind", type=int, default=4, help="images per shape (default 4: twelve in all)")
    args = parser.parse_args(argv)
    paths = make_dataset(args.out, seed=args.seed, per_kind=args.per_kind)
    total = sum(path.stat().st_size + path.with_suffix(".txt").stat().st_size for path in paths)
    print(f"wrote {len(paths)} images with captions to {args.out} ({total / 1024:.1f} KiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
