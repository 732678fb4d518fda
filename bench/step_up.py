"""Stepping up, measured: the same conservative config trained with and without ``--no-step-up``, side by side.

Each case is a user's config that holds back (micro-batch 1 with accumulation 4, gradient checkpointing) on a
machine with room to spare: the run with stepping up stops after its first steady steps and resumes with larger
settings; ``--no-step-up`` keeps the config. The table gives each run's wall time (loading and the restarts
included), its steady images per second at the end (the last attempt's median step), its final settings, the
step it ended at and its step-ups, read from the run's own files.

    python bench/step_up.py                        # tiny-sd15 and tiny-flux on examples/dataset, 64 steps
    python bench/step_up.py --steps 96 --cases tiny-sd15
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

import toml

ROOT = Path(__file__).resolve().parents[1]
DATASET = ROOT / "examples" / "dataset"
COMMON = {"resolution": "64,64", "network_dim": 4, "optimizer_type": "AdamW", "max_data_loader_n_workers": 0,
          "train_batch_size": 1, "gradient_accumulation_steps": 4, "gradient_checkpointing": True,
          "caption_extension": ".txt", "seed": 1}
FLUX = {"t5xxl_max_token_length": 16, "model_prediction_type": "raw", "timestep_sampling": "shift",
        "discrete_flow_shift": 3.0, "guidance_scale": 1.0, "network_module": "networks.lora_flux",
        "network_train_unet_only": True}
CASES = {"tiny-sd15": {}, "tiny-flux": FLUX}


def train(case: str, steps: int, folder: Path, *extra: str) -> dict:
    config = folder / f"{case}.toml"
    config.write_text(toml.dumps({**COMMON, **CASES[case], "max_train_steps": steps}), encoding="utf-8")
    out = folder / f"{case}{'-kept' if extra else ''}"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "autotune", "run", str(DATASET), "--model", f"builtin:{case}",
                           "--config", str(config), "--out", str(out), *extra], capture_output=True, text=True,
                          cwd=folder, env={**os.environ, "AUTOTUNE_CACHE_DIR": str(folder / "cache")}, check=False)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"{case}: autotune run failed ({done.returncode}): {done.stderr.strip()[-400:]}")
    event = json.loads(next((out / "logs" / "events").glob("done.json")).read_text(encoding="utf-8"))
    final = toml.loads((out / "config.final.toml").read_text(encoding="utf-8"))
    retries_file = out / "logs" / "retries.json"
    retries = json.loads(retries_file.read_text(encoding="utf-8")) if retries_file.is_file() else []
    step = statistics.median(event["step_seconds"]) if event.get("step_seconds") else event["seconds_per_step"]
    return {"wall": wall, "images_per_s": 4 / step, "steps": event["steps"],
            "final": f"{final['train_batch_size']} x {final['gradient_accumulation_steps']}"
                     f"{', checkpointing' if final.get('gradient_checkpointing') else ''}",
            "ups": sum(r["failure"] == "step_up" for r in retries)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="step-up-") as name:
        folder = Path(name)
        for case in args.cases:
            rows.append((case, "step up", train(case, args.steps, folder)))
            rows.append((case, "--no-step-up", train(case, args.steps, folder, "--no-step-up")))
    print(f"{args.steps} steps, effective batch 4, 64 px, examples/dataset, this machine's CPU\n")
    print("| model | run | ended at step | steps up | final micro-batch x accum | images/s at the end | wall s |"
          " images/s vs --no-step-up |")
    print("|---|---|---|---|---|---|---|---|")
    for i, (case, label, row) in enumerate(rows):
        base = row if label == "--no-step-up" else rows[i + 1][2]
        print(f"| {case} | {label} | {row['steps']} | {row['ups']} | {row['final']} | {row['images_per_s']:.2f} | "
              f"{row['wall']:.1f} | {row['images_per_s'] / base['images_per_s']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
