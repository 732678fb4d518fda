"""Memory that plans learn, measured: the plan's peak from the memory model, then from this machine's runs.

In a fresh measurement store (a temporary ``AUTOTUNE_CACHE_DIR``), for one model on ``examples/dataset``:

1. ``autotune plan --json --no-learn --batch B`` for each micro-batch: the memory model's peak;
2. ``autotune run --batch B`` for the ``--teach`` micro-batches: each run stores its measured peak (CUDA max
   reserved on a GPU, peak resident memory on a CPU) beside the model's prediction;
3. ``autotune plan --json --batch B`` again for every micro-batch: measured where a run had that setting, scaled
   by the nearest run's measured / predicted otherwise;
4. ``autotune run --batch B`` of the micro-batches no run taught: what they really peak at.

Prints one row per micro-batch: the model's figure, the learned one and its source, and the measured peak, with
the ratios learned / measured and model / measured.

    python bench/learned_memory.py                      # builtin:tiny-sd15, taught by micro-batch 1 and 2
    python bench/learned_memory.py --model builtin:tiny-sdxl --teach 1 --batches 1 2 4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATASET = ROOT / "examples" / "dataset"
MIB = 2**20
sys.path.insert(0, str(ROOT))


def autotune(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    from bench.learned_plan import autotune as run_cli  # how a bench runs the CLI: one place

    return run_cli(*argv, env=env)


def planned(model: str, batch: int, env: dict[str, str], *extra: str) -> dict:
    out = autotune("plan", str(DATASET), "--model", model, "--batch", str(batch), "--json", *extra, env=env)
    return json.loads(out.stdout)["prediction"]


def measured_peak(model: str, batch: int, steps: int, out: Path, env: dict[str, str]) -> float:
    """Train ``steps`` steps at micro-batch ``batch``; its done.json's peak (MiB)."""
    autotune("run", str(DATASET), "--model", model, "--batch", str(batch), "--steps", str(steps), "--out",
             str(out), env=env)
    done = json.loads(next(out.rglob("done.json")).read_text(encoding="utf-8"))
    return float(done["peak_memory"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="builtin:tiny-sd15")
    parser.add_argument("--teach", type=int, nargs="+", default=[1, 2], help="micro-batches whose runs teach")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4], help="micro-batches planned")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="learned-memory-") as folder:
        env = {**os.environ, "AUTOTUNE_CACHE_DIR": str(Path(folder) / "cache"), "HF_HUB_OFFLINE": "1"}
        model = {b: planned(args.model, b, env, "--no-learn")["peak_bytes"] / MIB for b in args.batches}
        peaks = {b: measured_peak(args.model, b, args.steps, Path(folder) / f"teach-{b}", env) for b in args.teach}
        learned = {b: planned(args.model, b, env) for b in args.batches}
        for b in args.batches:
            if b not in peaks:
                peaks[b] = measured_peak(args.model, b, args.steps, Path(folder) / f"check-{b}", env)
    print(f"{args.model} on examples/dataset, {args.steps} steps per run; runs at micro-batch "
          f"{', '.join(map(str, args.teach))} taught the plan\n")
    print("| micro-batch | model (MiB) | learned (MiB) | source | factor | measured (MiB) | learned / measured "
          "| model / measured |")
    print("|---|---|---|---|---|---|---|---|")
    for b in args.batches:
        got = learned[b]["peak_bytes"] / MIB
        source, factor = learned[b]["memory_source"], learned[b]["memory_factor"]
        print(f"| {b} | {model[b]:.0f} | {got:.0f} | {source} | {factor:.3g} | {peaks[b]:.0f} | "
              f"{got / peaks[b]:.3f} | {model[b] / peaks[b]:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
