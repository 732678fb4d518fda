"""Plans that learn, measured: the plan's prediction from the models, then from a bench, against a real run.

In a fresh measurement store (a temporary ``AUTOTUNE_CACHE_DIR``), for one model and dataset:

1. ``autotune plan --json``: the models' prediction (source "model");
2. ``autotune bench`` of that plan (``--steps`` timed steps);
3. ``autotune plan --json`` again: now from the measurement (source "measured");
4. ``autotune run`` of that plan: the run's own steady-state seconds per step (its done.json).

Prints a table of each prediction against what the run measured (ratio predicted / measured). This VM's speed
drifts 10-20% between runs, so ``--repeats`` reruns steps 2-4 and the table shows each repeat.

``--calibrate-cpu`` instead measures benches of several sizes (tiny-sd15 at 64 / 128 / 256 px, tiny-sdxl at 256
px; with ``--full`` also sd15 at 256 px), micro-batch 1 and 4, fp32 and bf16, and fits the CPU speed model's four
terms per precision (``autotune.calibration.cpu_speed``), printing the points and the constants to put in
``autotune/estimate/speed_model.py``.

    python bench/learned_plan.py                        # builtin:tiny-sd15 on examples/dataset
    python bench/learned_plan.py --repeats 2 --steps 6
    python bench/learned_plan.py --calibrate-cpu [--full]
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


def autotune(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "autotune", *argv], cwd=ROOT, capture_output=True, text=True,
                          env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"autotune {' '.join(argv)} failed ({done.returncode}): {done.stderr[-1500:]}")
    return done


def plan_prediction(model: str, dataset: str, env: dict[str, str]) -> dict:
    plan = json.loads(autotune("plan", dataset, "--model", model, "--json", env=env).stdout)
    return {"settings": plan["settings"], **{k: plan["prediction"][k] for k in
                                             ("seconds_per_step", "speed_source", "speed_basis")}}


def learned_rows(model: str, dataset: str, steps: int, repeats: int) -> list[dict]:
    from autotune.measure.store import steady_seconds_per_step

    rows = []
    with tempfile.TemporaryDirectory(prefix="learned-plan-") as tmp:
        env = {**os.environ, "AUTOTUNE_CACHE_DIR": str(Path(tmp) / "cache"), "HF_HUB_OFFLINE": "1"}
        first = plan_prediction(model, dataset, env)
        for repeat in range(repeats):
            autotune("bench", dataset, "--model", model, "--steps", str(steps), "--json", env=env)
            learned = plan_prediction(model, dataset, env)
            out = Path(tmp) / f"run{repeat}"
            autotune("run", dataset, "--model", model, "--out", str(out), env=env)
            done = json.loads((out / "logs/events" / "done.json").read_text())
            measured = steady_seconds_per_step(done)  # the median step, as the store keeps it
            for label, prediction in (("plan from the models", first), ("plan after autotune bench", learned)):
                if label.endswith("models") and repeat:
                    continue
                rows.append({"repeat": repeat, "prediction": label, "source": prediction["speed_source"],
                             "predicted_s_per_step": prediction["seconds_per_step"], "run_s_per_step": measured,
                             "ratio": prediction["seconds_per_step"] / measured, "run_steps": done["steps"],
                             "same_settings": prediction["settings"] == done["settings"]})
    return rows


def print_learned(rows: list[dict], model: str) -> None:
    print(f"\n{model}: predicted vs measured seconds per optimizer step (the run's done.json: its median step)\n")
    print("| repeat | prediction | source | predicted s/step | run s/step | predicted / run |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['repeat']} | {r['prediction']} | {r['source']} | {r['predicted_s_per_step']:.4f} | "
              f"{r['run_s_per_step']:.4f} | {r['ratio']:.2f} |")


def calibrate_cpu(full: bool, steps: int) -> None:
    """Benches of several sizes at micro-batch 1 and 4, fp32 and bf16 -> the CPU model's four terms per precision."""
    import psutil

    from autotune.calibration.cpu_speed import cpu_point, fit_cpu_speed
    from autotune.estimate.speed_model import CPU_NATIVE_BF16_GAIN
    from sd_scripts_compat.facts.settings import TrainSettings

    cases = [("tiny-sd15", 64), ("tiny-sd15", 128), ("tiny-sd15", 256), ("tiny-sdxl", 256)]
    if full:
        cases.append(("sd15", 256))
    # the cores the runs compute on: OMP_NUM_THREADS where set (a shared machine), else the physical cores
    cores = int(os.environ.get("OMP_NUM_THREADS") or psutil.cpu_count(logical=False) or 1)
    points: dict[str, list] = {"fp32": [], "bf16": []}
    per_sample: dict[str, dict[int, float]] = {"fp32": {}, "bf16": {}}
    print("| model | px | micro-batch | precision | GFLOP per micro-step | measured s per micro-step |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="calibrate-cpu-") as tmp:
        env = {**os.environ, "AUTOTUNE_CACHE_DIR": str(Path(tmp) / "cache"), "HF_HUB_OFFLINE": "1"}
        for family, px in cases:
            # no dataset: the bench's synthetic one, as large as the resolution (buckets never upscale)
            done = autotune("bench", "--model", f"builtin:{family}", "--resolution", str(px), "--steps", str(steps),
                            "--sweep", "precision=no,bf16", "--sweep", "batch=1,4", "--json", "--no-store", env=env)
            for point in json.loads(done.stdout)["points"]:
                settings = TrainSettings.from_event(point["settings"])
                seconds = point["seconds_per_step"] / settings.gradient_accumulation_steps
                precision, features = cpu_point(family, settings, seconds, cores)
                points[precision].append(features)
                if family == "sd15":
                    per_sample[precision][settings.train_batch_size] = seconds
                print(f"| {family} | {px} | {settings.train_batch_size} | {precision} | "
                      f"{features.flops_per_micro_step / 1e9:.2f} | {seconds:.4f} |")
    fp32 = fit_cpu_speed(points["fp32"])
    gain = CPU_NATIVE_BF16_GAIN  # the sd15 per-sample slopes give it; without --full the shipped one
    if len(per_sample["fp32"]) == 2 and len(per_sample["bf16"]) == 2:
        gain = (per_sample["fp32"][4] - per_sample["fp32"][1]) / (per_sample["bf16"][4] - per_sample["bf16"][1])
    bf16 = fit_cpu_speed(points["bf16"], gflops_per_core=fp32[2] * gain)
    for name, fit in (("CPU_FP32", fp32), ("CPU_BF16", bf16)):
        print(f"{name} = CpuCoefficients(overhead_s={fit[0]:.4f}, weight_gbs={fit[1]:.2f}, "
              f"gflops_per_core={fit[2]:.1f}, activation_gbs={fit[3]:.2f})  # {cores} cores")
    print(f"CPU_NATIVE_BF16_GAIN = {gain:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-sd15")
    parser.add_argument("--dataset", default=str(DATASET))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--calibrate-cpu", action="store_true")
    parser.add_argument("--full", action="store_true", help="with --calibrate-cpu: also sd15 at 256 px (slow)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    if args.calibrate_cpu:
        calibrate_cpu(args.full, args.steps)
        return
    rows = learned_rows(args.model, args.dataset, args.steps, args.repeats)
    print_learned(rows, args.model)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
