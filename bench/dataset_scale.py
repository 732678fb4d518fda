"""How each step that reads a dataset grows with it: 1k, 10k and 100k images, per-image cost and peak memory.

    python bench/dataset_scale.py                     # 1000,10000,100000 images under a temporary folder
    python bench/dataset_scale.py --sizes 1000,10000 --keep /tmp/scale

Each size is a generated dataset (deleted afterwards unless ``--keep``): small PNGs of 256-448 px in five
aspect ratios (flat colour with one unique pixel, so no two files are equal), each with a caption that starts
with its folder's trigger, 10,000 images per ``5_styleN`` folder. Each step runs as its own process, as a user
runs it, so every time includes the interpreter's start (about a second), and its peak RSS is that process's
(``os.wait4``):

- scan: the engine's dataset scan and the planner's summary (``autotune.planning.dataset.scan_dataset``);
- plan cold / warm: ``autotune plan DATASET --model builtin:tiny-sd15 --vram 8 --no-learn``, then the same again;
- doctor --quick / doctor / doctor again: ``autotune doctor DATASET --model builtin:tiny-sd15 --json`` (the full
  one decodes every image over all the cores; again, it reads what the first kept in the user cache folder, and
  no image);
- loader start: the engine's ``build_dataset`` for the dataset (captions, image sizes, buckets);
- latent caching: ``cache_latents`` with the tiny SD1.5 VAE on the first ``--cache-images`` images (default 1000,
  the same number at every size: its cost per image does not depend on the dataset; what does is the
  loader that feeds it, above).

The table gives seconds, microseconds per image, the marginal cost per image from the previous size (the
start-up cost cancels) and the peak RSS. Nothing is asserted: tests/test_dataset_scale.py counts listings and
opens instead.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = ((256, 256), (256, 384), (384, 256), (320, 256), (256, 448))
PER_FOLDER = 10_000

LOADER = """
import sys
from pathlib import Path
from sd_scripts_compat.dataset.train_dataset import build_dataset
from sd_scripts_compat.facts.dataset_spec import DatasetSpec, SubsetSpec
root = Path(sys.argv[1])
subsets = tuple(SubsetSpec(str(f), num_repeats=5, caption_extension=".txt") for f in sorted(root.iterdir()))
spec = DatasetSpec(subsets=subsets, resolution=(256, 256), batch_size=1, enable_bucket=True, min_bucket_reso=128,
                   max_bucket_reso=512, bucket_reso_steps=64)
assert build_dataset(spec, seed=0).records
"""

CACHING = """
import sys, time, warnings
from pathlib import Path
import torch
from sd_scripts_compat.caching.latent_cache import cache_latents
from sd_scripts_compat.dataset.train_dataset import build_dataset
from sd_scripts_compat.facts.dataset_spec import DatasetSpec, SubsetSpec
from sd_scripts_compat.runtimes import load_base_model
warnings.simplefilter("ignore")
torch.set_num_threads(len(__import__("os").sched_getaffinity(0)))
source, count = Path(sys.argv[1]), int(sys.argv[2])
spec = DatasetSpec(subsets=(SubsetSpec(str(source), num_repeats=1, caption_extension=".txt"),), resolution=(256, 256),
                   batch_size=1, enable_bucket=True, min_bucket_reso=128, max_bucket_reso=512, bucket_reso_steps=64)
dataset = build_dataset(spec, seed=0)
dataset.records = dataset.records[:count]
bundle = load_base_model("builtin:tiny-sd15")
began = time.perf_counter()
cache_latents(dataset, bundle.vae, vae_batch_size=8)
print(time.perf_counter() - began)
"""


def make_dataset(root: Path, count: int) -> Path:
    rng = random.Random(count)
    folders = max(1, -(-count // PER_FOLDER))
    from PIL import Image

    for index in range(count):
        folder = root / f"5_style{index % folders}"
        if index < folders:
            folder.mkdir(parents=True, exist_ok=True)
        width, height = SIZES[index % len(SIZES)]
        image = Image.new("RGB", (width, height), tuple(rng.randrange(256) for _ in range(3)))
        image.putpixel((index % width, index // width % height), (index % 256, index // 256 % 256, 1))
        image.save(folder / f"img{index:06d}.png", compress_level=1)
        (folder / f"img{index:06d}.txt").write_text(f"style{index % folders}, tag{index % 97}, tag{index % 13}")
    return root


def timed(command: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """(seconds, peak RSS MiB, stdout's last line) of one process; a failure stops the bench with its stderr."""
    began = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, env=env, cwd=ROOT)
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - began
        out.seek(0)
        err.seek(0)
        text, errors = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{errors[-2000:]}")
    return seconds, usage.ru_maxrss / 1024, (text.strip().splitlines() or [""])[-1]


def measure(dataset: Path, count: int, cache_images: int, env: dict[str, str]) -> dict[str, tuple[float, float]]:
    python, autotune = sys.executable, [sys.executable, "-m", "autotune"]
    model = ["--model", "builtin:tiny-sd15"]
    steps: dict[str, list[str]] = {
        "scan": [python, "-c", f"from autotune.planning.dataset import scan_dataset; scan_dataset({str(dataset)!r})"],
        "plan cold": [*autotune, "plan", str(dataset), *model, "--vram", "8", "--no-learn"],
        "plan warm": [*autotune, "plan", str(dataset), *model, "--vram", "8", "--no-learn"],
        "doctor --quick": [*autotune, "doctor", str(dataset), *model, "--json", "--quick"],
        "doctor": [*autotune, "doctor", str(dataset), *model, "--json"],
        "doctor again": [*autotune, "doctor", str(dataset), *model, "--json"],
        "loader start": [python, "-c", LOADER, str(dataset)],
    }
    results = {}
    for name, command in steps.items():
        seconds, rss, _ = timed(command, env)
        results[name] = (seconds, rss)
        print(f"  {count} images, {name}: {seconds:.2f} s, {rss:.0f} MiB", file=sys.stderr)
    first = sorted(dataset.iterdir())[0]
    _, rss, line = timed([python, "-c", CACHING, str(first), str(min(cache_images, count))], env)
    results["latent caching"] = (float(line) * count / min(cache_images, count), rss)  # scaled to every image
    return results


def table(results: dict[int, dict[str, tuple[float, float]]], cache_images: int) -> str:
    sizes = sorted(results)
    head = ["step", *(f"{n // 1000}k s" for n in sizes), *(f"{n // 1000}k us/image" for n in sizes),
            *(f"{b // 1000}k-{a // 1000}k marginal us/image" for a, b in zip(sizes, sizes[1:])),
            f"ratio {sizes[-1] // 1000}k/{sizes[0] // 1000}k per image", f"peak RSS at {sizes[-1] // 1000}k MiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for step in results[sizes[0]]:
        seconds = [results[n][step][0] for n in sizes]
        per = [s / n * 1e6 for s, n in zip(seconds, sizes)]
        marginal = [(seconds[i + 1] - seconds[i]) / (sizes[i + 1] - sizes[i]) * 1e6 for i in range(len(sizes) - 1)]
        name = f"{step} (timed on {cache_images} images, scaled)" if step == "latent caching" else step
        cells = [name, *(f"{s:.2f}" for s in seconds), *(f"{p:.0f}" for p in per), *(f"{m:.0f}" for m in marginal),
                 f"{per[-1] / per[0]:.2f}", f"{results[sizes[-1]][step][1]:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--cache-images", type=int, default=1000)
    parser.add_argument("--keep", type=Path, default=None, help="generate (or reuse) the datasets here and keep them")
    args = parser.parse_args()
    sizes = [int(n) for n in args.sizes.split(",")]
    work = args.keep or Path(tempfile.mkdtemp(prefix="dataset-scale-"))
    results = {}
    try:
        for count in sizes:
            dataset = work / f"images-{count}"
            if not dataset.is_dir():
                began = time.perf_counter()
                make_dataset(dataset, count)
                print(f"generated {count} images in {time.perf_counter() - began:.0f} s", file=sys.stderr)
            env = {**os.environ, "AUTOTUNE_CACHE_DIR": str(work / f"cache-{count}"), "HF_HUB_OFFLINE": "1",
                   "PYTHONWARNINGS": "ignore"}
            results[count] = measure(dataset, count, args.cache_images, env)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{os.cpu_count()} CPU cores; python {sys.version.split()[0]}\n")
    print(table(results, args.cache_images))


if __name__ == "__main__":
    main()
