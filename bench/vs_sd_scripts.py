"""Our engine against the user's sd-scripts, side by side on this machine: the same model file, config and dataset.

Needs a local sd-scripts checkout and the Python that runs it (never committed; the benchmark says so and stops
when they are absent):

    LORA_AUTOTUNE_SD_SCRIPTS=~/sd-scripts LORA_AUTOTUNE_SD_SCRIPTS_PYTHON=~/sd-scripts/venv/bin/python \\
        python bench/vs_sd_scripts.py --pairs 5 --steps 10 --precision no,bf16

It writes one random-weight SD1.5 single file (fp16, kohya's original layout; ``--family sdxl`` for SDXL at a
small ``--resolution``), one config.toml both engines read unchanged (batch 1, rank 8, UNet only, AdamW, cached
latents, SDPA) and runs the two alternately, ``--pairs`` times per precision, each run waiting for a quiet
machine first (1-minute load average under ``--quiet-load``). Both run under the same launcher, which registers
torch's global optimizer-step hook: a step's time is the gap between two optimizer steps' ends, steps 3..N timed.
Whole-run wall time and peak RSS (``ru_maxrss``) come from the same launcher. The table gives each side's median
s/step, the median of the paired per-pair ratios (ours / sd-scripts), and the wall-time and RSS ratios; it then
checks that both LoRA files hold the same modules (key names and shapes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATASET = ROOT / "examples" / "dataset"
SCRIPTS_ENV, PYTHON_ENV = "LORA_AUTOTUNE_SD_SCRIPTS", "LORA_AUTOTUNE_SD_SCRIPTS_PYTHON"
TIMED_FROM = 2  # steps 1 and 2 warm up; step 3 onwards is timed
# The launcher both engines run under: torch's global optimizer-step hook stamps each step's end; the stamps,
# the wall time and the peak RSS go to $VS_TIMES when the process exits.
LAUNCHER = """
import atexit, json, os, resource, runpy, sys, time
from torch.optim.optimizer import register_optimizer_step_post_hook
began, ends = time.perf_counter(), []
register_optimizer_step_post_hook(lambda *_: ends.append(time.perf_counter()))
def dump():
    with open(os.environ["VS_TIMES"], "w") as f:
        json.dump({"ends": ends, "wall": time.perf_counter() - began,
                   "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}, f)
atexit.register(dump)
target, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
if target.endswith(".py"):
    sys.path.insert(0, os.path.dirname(target))
    runpy.run_path(target, run_name="__main__")
else:
    runpy.run_module(target, run_name="__main__", alter_sys=True)
"""


def write_model(family_name: str, path: Path) -> Path:
    """A random-weight model of the family as one fp16 single file (kept between invocations with ``--work``)."""
    if path.is_file():
        return path
    import torch

    from sd_scripts_compat.models.build import build_modules
    from sd_scripts_compat.models.families import get_family
    from sd_scripts_compat.models.single_file import save_single_file

    save_single_file(build_modules(get_family(family_name), seed=0), path, dtype=torch.float16)
    return path


def write_config(work: Path, model: Path, resolution: int, steps: int, precision: str) -> tuple[Path, Path]:
    """config.toml + dataset.toml both engines read (only ``output_dir`` differs, given on the command line)."""
    import toml

    dataset = work / "dataset.toml"
    subsets = [{"image_dir": str(folder), "num_repeats": int(folder.name.split("_", 1)[0])}
               for folder in sorted(DATASET.iterdir()) if folder.is_dir() and folder.name.split("_", 1)[0].isdigit()]
    dataset.write_text(toml.dumps({"general": {"caption_extension": ".txt", "enable_bucket": False},
                                   "datasets": [{"resolution": resolution, "batch_size": 1, "subsets": subsets}]}))
    config = work / f"config-{precision}.toml"
    config.write_text(toml.dumps({
        "pretrained_model_name_or_path": str(model), "dataset_config": str(dataset), "network_module": "networks.lora",
        "network_dim": 8, "network_alpha": 8, "network_train_unet_only": True, "optimizer_type": "AdamW",
        "learning_rate": 1e-4, "lr_scheduler": "constant", "max_train_steps": steps, "cache_latents": True,
        "mixed_precision": precision, "save_precision": "float", "sdpa": True, "seed": 42,
        "max_data_loader_n_workers": 0, "save_model_as": "safetensors", "output_name": "lora",
        "max_grad_norm": 1.0}))
    return config, dataset


def wait_for_quiet(limit: float, timeout_s: float = 300.0) -> float:
    deadline = time.monotonic() + timeout_s
    while os.getloadavg()[0] > limit and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


def run_side(side: str, config: Path, out: Path, install: dict[str, str], tokenizers: Path | None) -> dict:
    """One run of ``side`` (ours or sd-scripts) under the launcher; its step times, wall time, peak RSS, LoRA."""
    times = out / "times.json"
    if side == "ours":
        command = [sys.executable, "-c", LAUNCHER, "sd_scripts_compat.train_network"]
        cwd = ROOT
    else:
        command = [install["python"], "-c", LAUNCHER, str(Path(install["scripts"]) / "train_network.py")]
        cwd = Path(install["scripts"])
    command += ["--config_file", str(config), "--output_dir", str(out)]
    if side == "sd-scripts" and tokenizers is not None:
        command += ["--tokenizer_cache_dir", str(tokenizers)]
    env = {**os.environ, "VS_TIMES": str(times), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0 or not times.is_file():
        raise SystemExit(f"{side} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    record = json.loads(times.read_text())
    ends = record["ends"]
    return {"step_seconds": [b - a for a, b in zip(ends[TIMED_FROM - 1:], ends[TIMED_FROM:])],
            "wall_s": record["wall"], "peak_rss_mib": record["peak_rss_mib"], "lora": str(out / "lora.safetensors")}


def modules(path: str) -> dict[str, list[int]]:
    from safetensors import safe_open

    with safe_open(path, "pt") as file:
        return {key: list(file.get_slice(key).get_shape()) for key in file.keys()}


def compare(precision: str, pairs: list[tuple[dict, dict]]) -> dict:
    ours = [statistics.median(o["step_seconds"]) for o, _ in pairs]
    theirs = [statistics.median(k["step_seconds"]) for _, k in pairs]
    same = modules(pairs[0][0]["lora"]) == modules(pairs[0][1]["lora"])
    return {"precision": precision, "ours_s": statistics.median(ours), "sd_scripts_s": statistics.median(theirs),
            "step_ratio": statistics.median(o / k for o, k in zip(ours, theirs)),
            "wall_ratio": statistics.median(o["wall_s"] / k["wall_s"] for o, k in pairs),
            "rss_ratio": statistics.median(o["peak_rss_mib"] / k["peak_rss_mib"] for o, k in pairs),
            "pairs": len(pairs), "same_modules": same, "modules": len(modules(pairs[0][0]["lora"])),
            "runs": [{"ours": o, "sd_scripts": k} for o, k in pairs]}


def print_rows(rows: list[dict], family: str, resolution: int, steps: int) -> None:
    print(f"\n{family} random weights, {resolution} px, batch 1, rank 8, UNet only, AdamW, cached latents; "
          f"steps {TIMED_FROM + 1}..{steps} timed; ratios are the median of the alternating pairs' ours / sd-scripts")
    print("| precision | pairs | ours s/step | sd-scripts s/step | step ratio | wall ratio | peak RSS ratio | "
          "same modules |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['precision']} | {r['pairs']} | {r['ours_s']:.3f} | {r['sd_scripts_s']:.3f} | "
              f"{r['step_ratio']:.2f} | {r['wall_ratio']:.2f} | {r['rss_ratio']:.2f} | "
              f"{'yes' if r['same_modules'] else 'NO'} ({r['modules']} tensors) |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="sd15", help="sd15 (default) or sdxl")
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run (the first two warm up)")
    parser.add_argument("--pairs", type=int, default=5, help="alternating runs per side and precision")
    parser.add_argument("--precision", default="no,bf16", help="mixed_precision values, comma-separated")
    parser.add_argument("--quiet-load", type=float, default=0.5, help="wait until the 1-minute load is below this")
    parser.add_argument("--work", help="keep the model file and runs here (default: a temporary folder)")
    parser.add_argument("--json", help="also write every figure to this file")
    args = parser.parse_args()
    scripts = os.environ.get(SCRIPTS_ENV)
    if not scripts:
        print(f"{SCRIPTS_ENV} is not set: point it at an sd-scripts checkout (and {PYTHON_ENV} at its Python) to "
              "compare; nothing was run", file=sys.stderr)
        return 0
    from autotune.recovery.sd_scripts import find_install, tokenizer_cache
    from sd_scripts_compat.models.families import get_family

    found = find_install(Path(scripts).expanduser(), os.environ.get(PYTHON_ENV))
    install = {"scripts": str(found.scripts_dir), "python": str(found.python)}
    work = Path(args.work).expanduser() if args.work else Path(tempfile.mkdtemp(prefix="vs-sd-scripts-"))
    work.mkdir(parents=True, exist_ok=True)
    family = get_family(args.family)
    model = write_model(args.family, work / f"{args.family}-random.safetensors")
    pads = tuple(str(te.tokenizer.get("pad_token") or "<|endoftext|>") for te in family.text_encoders)
    tokenizers = tokenizer_cache(work, family.single_file_layout, pads)
    rows = []
    for precision in args.precision.split(","):
        config, _ = write_config(work, model, args.resolution, args.steps, precision)
        pairs = []
        for pair in range(args.pairs):
            order = ("ours", "sd-scripts") if pair % 2 == 0 else ("sd-scripts", "ours")
            result = {}
            for side in order:
                load = wait_for_quiet(args.quiet_load)
                result[side] = run_side(side, config, work / f"{precision}-{pair}-{side}", install, tokenizers)
                print(f"{precision} pair {pair + 1} {side}: {statistics.median(result[side]['step_seconds']):.3f} "
                      f"s/step, {result[side]['wall_s']:.0f} s wall (load before {load:.2f})", file=sys.stderr,
                      flush=True)
            pairs.append((result["ours"], result["sd-scripts"]))
        rows.append(compare(precision, pairs))
    print_rows(rows, args.family, args.resolution, args.steps)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
