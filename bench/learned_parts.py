"""Memory learned per part, on a card emulated on this CPU: a run at micro-batch 1 is measured, then micro-batch 4
is predicted three ways (the memory model alone; the model times one measured / predicted ratio of the whole
peak; each part by its own ratio: what stays on the card between steps, the weights, LoRA and optimizer state,
and the rest of the peak) and measured by a run of its own. The planner takes the third where the measured run
read its resident memory (``autotune.measure.learned``).

    python bench/learned_parts.py                       # tiny-sd15 and tiny-flux, fp32 and bf16, both TE ways
    python bench/learned_parts.py --models tiny-flux --precisions no --text-encoder off

A ratio below 1 lowers nothing here: the measured run (micro-batch 1) is lighter than the predicted one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATASET = ROOT / "examples" / "dataset"
CARD_MIB = 2000.0  # room for every case: the runs measure, they do not step


def train(folder: Path, model: str, precision: str, batch: int, text_encoder: bool) -> dict[str, Any]:
    """A four-step run on the emulated card; its done.json."""
    config = folder / f"{model}-{precision}-{batch}.toml"
    config.write_text(f'resolution = "256,256"\nnetwork_dim = 32\noptimizer_type = "AdamW"\n'
                      f'mixed_precision = "{precision}"\ntrain_batch_size = {batch}\nmax_train_steps = 4\n'
                      'cache_latents = true\nmax_data_loader_n_workers = 0\ncaption_extension = ".txt"\nseed = 1\n'
                      f'network_train_unet_only = {"false" if text_encoder else "true"}\n',
                      encoding="utf-8")
    out = folder / config.stem
    done = subprocess.run([sys.executable, "-m", "autotune", "run", str(DATASET), "--model", f"builtin:{model}",
                           "--config", str(config), "--out", str(out), "--emulate-card", f"{CARD_MIB:g}",
                           "--no-step-up"], capture_output=True, text=True, cwd=folder,
                          env={**os.environ, "AUTOTUNE_CACHE_DIR": str(folder / "cache"), "HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        raise SystemExit(f"{config.stem} failed: {done.stderr.strip()[-600:]}")
    return json.loads((out / "logs" / "events" / "done.json").read_text(encoding="utf-8"))


def predictions(model: str, first: dict[str, Any], second: dict[str, Any]) -> tuple[float, ...]:
    """The second run's peak as the model, one ratio and each part predict it from the first run (MiB)."""
    from autotune.estimate.memory_view import MemoryView
    from autotune.measure.learned import LearnedFigures
    from autotune.measure.store import from_done_event
    from autotune.planning.search import Predictor
    from sd_scripts_compat.facts.families import get_family
    from sd_scripts_compat.facts.settings import TrainSettings

    family = get_family(model)
    device = "emulated card (bench)"  # the run's own store key does not matter: the records are passed here
    record = from_done_event(first, device=device, family=family, source="run")
    assert record is not None and record.resident_mib, "the first run read no resident memory"
    settings = TrainSettings.from_event(second["settings"])

    def peak(records: tuple[Any, ...]) -> float:
        learned = LearnedFigures(records, device, family) or None
        predictor = Predictor(family, (), 2, learned=learned, usable=int(CARD_MIB * 2**20),
                              memory=MemoryView(emulated=True))
        return predictor.predict(settings).peak / 2**20

    return peak(()), peak((replace(record, resident_mib=None),)), peak((record,))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny-sd15", "tiny-flux"])
    parser.add_argument("--precisions", nargs="+", default=["no", "bf16"], help="mixed_precision of the runs")
    parser.add_argument("--text-encoder", choices=["off", "on", "both"], default="both",
                        help="train the text encoders' LoRA too (off: the denoiser's alone, as FLUX plans train)")
    args = parser.parse_args()
    print("| model | text encoder | precision | micro-batch 1: measured (resident; rest) | micro-batch 4 measured | "
          "model | one ratio | per part |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="learned-parts-") as tmp:
        for model in args.models:
            for text_encoder in {"off": (False,), "on": (True,), "both": (False, True)}[args.text_encoder]:
                for precision in args.precisions:
                    print(row(Path(tmp), model, text_encoder, precision), flush=True)


def row(tmp: Path, model: str, text_encoder: bool, precision: str) -> str:
    folder = tmp / f"{model}-{precision}-{'te' if text_encoder else 'unet'}"
    folder.mkdir()
    first, second = (train(folder, model, precision, batch, text_encoder) for batch in (1, 4))
    alone, whole, parts = predictions(model, first, second)
    measured = second["peak_memory"]
    cells = " | ".join(f"{value:.1f} ({value / measured - 1:+.0%})" for value in (alone, whole, parts))
    split = (f"{first['peak_memory']:.1f} MiB ({first['resident_memory']:.1f}; "
             f"{first['peak_memory'] - first['resident_memory']:.1f})")
    return (f"| {model} | {'trained' if text_encoder else 'frozen'} | {precision} | {split} | {measured:.1f} | "
            f"{cells} |")

if __name__ == "__main__":
    main()
