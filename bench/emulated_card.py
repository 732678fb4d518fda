"""Plans that learn, on a card emulated on this CPU (``autotune run --emulate-card``): runs planned with a memory
model deliberately wrong (``--memory-model-scale``), what the watchdog made of them, and what the next plan predicts.

For each model, on cards sized so that the wrong model matters (a fresh measurement store, ``--no-learn`` for the
biased runs so that each starts from the model alone):

- **pessimistic** (the model x1.4): the plan holds back; the run steps up into the measured headroom. Beside it the
  same run with ``--no-step-up``: images per second side by side.
- **optimistic** (x0.6): the plan does not fit; the first attempt runs out of memory and the ladder steps down by
  the measured OOM point.
- **ahead** (tiny-sd15, x0.6, a dataset whose largest bucket comes at step 11): the measured peak, carried by the
  model to the largest bucket, is over the card after the first step; the run steps down before the OOM. Beside it
  ``--no-step-up``, which runs out of memory when that bucket comes.
- **learned**: after those runs, ``autotune plan`` for each card with the same wrong model (and for one card no
  run used, with the pessimistic model): its chosen settings, the model's prediction for them before learning and
  the plan's after, then a short run of exactly those settings that measures them again.

    python bench/emulated_card.py                 # tiny-sd15 and tiny-flux, 30 steps each
    python bench/emulated_card.py --models tiny-flux --steps 40
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATASET = ROOT / "examples" / "dataset"
# card sizes (MiB of tensors) where the wrong model changes the plan (measured on this repo's tiny twins, 256 px)
CARDS = {"tiny-sd15": {"pessimistic": 70.0, "optimistic": 50.0, "ahead": 50.0},
         "tiny-flux": {"pessimistic": 9.6, "optimistic": 5.0}}
SCALES = {"pessimistic": 1.4, "optimistic": 0.6, "ahead": 0.6}
UNSEEN = {"tiny-sd15": 30.0, "tiny-flux": 7.0}  # a card no run used: its plan may choose settings never measured
AHEAD_SEED = 23  # with it, the mixed dataset's one large micro-batch comes eleventh in the first epoch


def mixed_sizes(root: Path) -> Path:
    """Four 256 x 192 images with 10 repeats and four 256 x 256 with 1: ten small micro-batches of 4 and one
    large one per epoch (the plan's bucket_no_upscale keeps them apart)."""
    from PIL import Image

    for folder, size, count in (("10_small shape", (256, 192), 4), ("1_big shape", (256, 256), 4)):
        (root / folder).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            Image.new("RGB", size, (40 * i, 90, 200 - 30 * i)).save(root / folder / f"{i}.png")
            (root / folder / f"{i}.txt").write_text(folder.split("_", 1)[1], encoding="utf-8")
    return root


def autotune(folder: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "autotune", *argv], capture_output=True, text=True, cwd=folder,
                          env={**os.environ, "AUTOTUNE_CACHE_DIR": str(folder / "cache"), "HF_HUB_OFFLINE": "1"},
                          check=False)


def train(folder: Path, name: str, model: str, card: float, scale: float, steps: int, dataset: Path,
          *extra: str) -> dict[str, Any]:
    out = folder / name
    started = time.monotonic()
    done = autotune(folder, "run", str(dataset), "--model", f"builtin:{model}", "--emulate-card", f"{card:g}",
                    "--memory-model-scale", f"{scale:g}", "--steps", str(steps), "--out", str(out), *extra)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"{name}: autotune run failed ({done.returncode}): {done.stderr.strip()[-400:]}")
    event = json.loads((out / "logs" / "events" / "done.json").read_text(encoding="utf-8"))
    retries_file = out / "logs" / "retries.json"
    retries = json.loads(retries_file.read_text(encoding="utf-8")) if retries_file.is_file() else []
    decisions: list[dict[str, Any]] = [json.loads(line) for line in (out / "logs" / "decisions.jsonl").read_text(
        encoding="utf-8").splitlines()]
    first = next((d.get("settings") or {} for d in decisions if d.get("event") == "start"), {})
    step = statistics.median(event["step_seconds"]) if event.get("step_seconds") else event["seconds_per_step"]
    final = event["settings"]
    return {"wall": wall, "images_per_s": final["train_batch_size"] * final["gradient_accumulation_steps"] / step,
            "steps": event["steps"], "peak": event["peak_memory"], "planned": short(first) if first else "?",
            "final": short(final), "moves": [f"{r['failure']} at {r['step']} "
                                             f"({'in the process' if r.get('in_process') else 'restart'}, lost "
                                             f"{r['steps_lost']})" for r in retries],
            "reasons": [r["reason"] for r in retries]}


def short(settings: dict[str, Any]) -> str:
    gc = ", checkpointing" if settings.get("gradient_checkpointing") else ""
    return f"{settings['train_batch_size']} x {settings['gradient_accumulation_steps']}{gc}"


def plan(folder: Path, model: str, card: float, scale: float, *extra: str) -> dict[str, Any]:
    done = autotune(folder, "plan", str(DATASET), "--model", f"builtin:{model}", "--emulate-card", f"{card:g}",
                    "--memory-model-scale", f"{scale:g}", "--json", *extra)
    if done.returncode != 0:
        raise SystemExit(f"plan {model} on {card:g} MiB failed: {done.stderr.strip()[-400:]}")
    return json.loads(done.stdout)


def model_peak_mib(model: str, settings: dict[str, Any], scale: float) -> float:
    """What the (wrong) memory model alone predicts for the plan's settings: the planner's figure before learning."""
    from autotune.estimate.memory_view import MemoryView
    from autotune.planning.search import Predictor
    from sd_scripts_compat.facts.families import get_family
    from sd_scripts_compat.facts.settings import TrainSettings

    predictor = Predictor(get_family(model), (), os.cpu_count() or 1, memory=MemoryView(emulated=True, scale=scale))
    return predictor.model_estimate(TrainSettings.from_event(settings)).peak / 2**20


def learned_row(folder: Path, model: str, card: float, scale: float, steps: int) -> str:
    after = plan(folder, model, card, scale)
    settings = after["settings"]
    check = train(folder, f"check-{model}-{card:g}", model, card, scale, steps, DATASET, "--no-step-up")
    model_mib = model_peak_mib(model, settings, scale)
    learned_mib = after["prediction"]["peak_bytes"] / 2**20
    return (f"| {model} | {card:g} | x{scale:g} | {short(settings)} | {model_mib:.1f} | {learned_mib:.1f} "
            f"({after['prediction']['memory_source']}) | {check['peak']:.1f} | {model_mib / check['peak']:.2f} | "
            f"{learned_mib / check['peak']:.3f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--models", nargs="+", default=list(CARDS), choices=list(CARDS))
    args = parser.parse_args(argv)
    runs, learned, reasons = [], [], []
    with tempfile.TemporaryDirectory(prefix="emulated-card-") as name:
        folder = Path(name)
        mixed = mixed_sizes(folder / "mixed")
        for model in args.models:
            for case, card in CARDS[model].items():
                scale, data = SCALES[case], mixed if case == "ahead" else DATASET
                extra = ("--no-learn", *(("--seed", str(AHEAD_SEED)) if case == "ahead" else ()))
                row = train(folder, f"{model}-{case}", model, card, scale, args.steps, data, *extra)
                runs.append((model, case, card, scale, "stepping", row))
                reasons += [f"{model}, {case}: {r}" for r in row["reasons"]]
                if case in ("pessimistic", "ahead"):
                    kept = train(folder, f"{model}-{case}-kept", model, card, scale, args.steps, data, *extra,
                                 "--no-step-up")
                    runs.append((model, case, card, scale, "--no-step-up", kept))
            cards = {size: SCALES[case] for case, size in CARDS[model].items()} | {UNSEEN[model]: 1.4}
            for card, scale in sorted(cards.items()):
                learned.append(learned_row(folder, model, card, scale, max(8, args.steps // 3)))
    print(f"{args.steps} steps, 256 px, effective batch 4, on a card emulated on this machine's CPU\n")
    print("| model | case | card MiB | model x | run | planned | final | moves | ended at | peak MiB | images/s |"
          " wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model, case, card, scale, label, row in runs:
        print(f"| {model} | {case} | {card:g} | {scale:g} | {label} | {row['planned']} | {row['final']} | "
              f"{'; '.join(row['moves']) or 'none'} | {row['steps']} | {row['peak']:.1f} | "
              f"{row['images_per_s']:.2f} | {row['wall']:.1f} |")
    print("\nafter those runs, `autotune plan` for each card with the same wrong model, and a run of its settings:\n")
    print("| model | card MiB | model x | planned | model MiB (before) | learned MiB (source) | measured MiB |"
          " before / measured | learned / measured |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(learned))
    print("\nthe decisions, as the log gives them:\n")
    print("\n".join(f"- {line}" for line in reasons))
    return 0


if __name__ == "__main__":
    sys.exit(main())
