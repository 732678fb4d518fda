"""Wall time of `autotune plan` (it must stay interactive): median of several runs, as subprocesses.

    python bench/plan.py [--runs 5] [--dataset examples/dataset]

Each run is a fresh `python -m autotune plan DATASET --model builtin:<family> --gpu "RTX 3060" --out TMP`,
so the figure includes interpreter start-up and imports, as a user sees it. A second table times
`plan_training` alone, in-process (the search itself). Uses examples/dataset when it exists, else a small
generated dataset in a temporary folder.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CASES = (("sdxl", "RTX 3060"), ("sd15", "RTX 3060"), ("sdxl", "RTX 4090"), ("sd15", "GTX 1080"))


def make_dataset(folder: Path) -> Path:
    """Twelve small captioned PNGs in 10_subject/ (only counted by the planner, never decoded)."""
    from PIL import Image

    sub = folder / "10_subject"
    sub.mkdir(parents=True, exist_ok=True)
    for i in range(12):
        Image.new("RGB", (64, 64), (i * 20 % 256, 80, 160)).save(sub / f"img{i:02d}.png")
        (sub / f"img{i:02d}.txt").write_text("subject, test image\n", encoding="utf-8")
    return folder


def time_cli(dataset: Path, family: str, gpu: str, runs: int, out: Path) -> list[float]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "autotune", "plan", str(dataset), "--model", f"builtin:{family}", "--gpu", gpu,
           "--out", str(out), "--json"]
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        times.append(time.perf_counter() - start)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return times


def time_in_process(dataset: Path, family: str, gpu: str, runs: int) -> list[float]:
    from autotune.hardware.gpu_catalog import lookup_gpu
    from autotune.planning.planner import PlanRequest, gpu_from_spec, plan_training

    request = PlanRequest(dataset_dir=str(dataset), model=f"builtin:{family}",
                          gpus=(gpu_from_spec(lookup_gpu(gpu)),), cpu_physical_cores=8)
    plan_training(request)  # first call pays the imports
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        plan_training(request)
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dataset", type=Path, default=ROOT / "examples" / "dataset")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        dataset = args.dataset if args.dataset.is_dir() else make_dataset(Path(tmp) / "dataset")
        print(f"dataset: {dataset}; {args.runs} runs each; python {sys.version.split()[0]}; {os.cpu_count()} CPUs")
        print()
        print("| command | median s | min s | max s |")
        print("|---|---|---|---|")
        for family, gpu in CASES:
            times = time_cli(dataset, family, gpu, args.runs, Path(tmp) / "out")
            print(f"| autotune plan --model builtin:{family} --gpu \"{gpu}\" | {statistics.median(times):.2f} | "
                  f"{min(times):.2f} | {max(times):.2f} |", flush=True)
        print()
        print("| plan_training in-process | median ms | min ms | max ms |")
        print("|---|---|---|---|")
        for family, gpu in CASES:
            times = time_in_process(dataset, family, gpu, args.runs)
            print(f"| {family} on {gpu} | {statistics.median(times) * 1e3:.1f} | {min(times) * 1e3:.1f} | "
                  f"{max(times) * 1e3:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
