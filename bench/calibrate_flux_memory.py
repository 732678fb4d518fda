"""Calibrate the transformer (DiT) memory model's FLUX.1 entry from fake-tensor traces of the full-size
transformer (``autotune.calibration.dit_memtrace``: the engine's modules and LoRA network); print traces vs model.

    python bench/calibrate_flux_memory.py            # trace (cached in --traces), fit, write the calibration
    python bench/calibrate_flux_memory.py --table    # only the table, from the stored traces

Activation coefficients per checkpointing setting come from four traces each (512 / 1024 px x rank 16 / 64,
batch 1, AdamW8bit, bf16 weights): ``act = c0 + c1*rank + batch*tokens*(a + b*rank)`` with tokens = packed image
tokens + the 512 T5 tokens, solved exactly; ``fp8_extra`` from one fp8 trace each. The VALIDATION traces
(other resolutions, batches, optimizers, fp8 and swap counts) are not used by the fit: the table compares them.
The text-encoder caching transient (CLIP-L + T5-XXL forwards, no grad) is traced too.
Each trace takes ~20-60 s on this CPU; the traces file keeps them so a rerun only traces what is new.
tiny-flux (the engine's test twin) gets its own ``variants`` entry from traces of its own model (seconds).
FLUX.1-schnell shares dev's transformer and coefficients (its 256 T5 tokens make dev's 512 a slight over-estimate).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autotune.estimate.dit_memory import (  # noqa: E402
    DIT_CALIBRATION_PATH,
    DitMemoryInputs,
    predict_dit_memory,
)
from sd_scripts_compat.models.families import get_family  # noqa: E402

GIB = 2**30
FIT = [dict(resolution=r, batch_size=1, rank=k, gradient_checkpointing=gc, optimizer="AdamW8bit", fp8_base=False,
            blocks_to_swap=0) for gc in (True, False) for r in (512, 1024) for k in (16, 64)]
FIT += [dict(resolution=1024, batch_size=1, rank=16, gradient_checkpointing=gc, optimizer="AdamW8bit", fp8_base=True,
             blocks_to_swap=0) for gc in (True, False)]
VALIDATION = [
    dict(resolution=1024, batch_size=2, rank=16, gradient_checkpointing=True, optimizer="AdamW8bit", fp8_base=True,
         blocks_to_swap=16),
    dict(resolution=512, batch_size=2, rank=32, gradient_checkpointing=True, optimizer="AdamW", fp8_base=True,
         blocks_to_swap=28),
    dict(resolution=1024, batch_size=1, rank=16, gradient_checkpointing=False, optimizer="AdamW8bit",
         fp8_base=False, blocks_to_swap=0),
    dict(resolution=512, batch_size=1, rank=32, gradient_checkpointing=False, optimizer="Adafactor", fp8_base=True,
         blocks_to_swap=8),
    dict(resolution=1024, batch_size=1, rank=32, gradient_checkpointing=True, optimizer="Prodigy", fp8_base=False,
         blocks_to_swap=22),
    dict(resolution=768, batch_size=1, rank=16, gradient_checkpointing=True, optimizer="AdamW8bit", fp8_base=True,
         blocks_to_swap=35),
    dict(resolution=512, batch_size=2, rank=16, gradient_checkpointing=False, optimizer="AdamW8bit",
         fp8_base=False, blocks_to_swap=10),
    dict(resolution=1024, batch_size=2, rank=8, gradient_checkpointing=False, optimizer="AdamW8bit", fp8_base=True,
         blocks_to_swap=4),
]


def _key(cfg: dict) -> str:
    return json.dumps(cfg, sort_keys=True)


def collect(traces_path: Path, configs: list[dict]) -> dict[str, dict]:
    """Trace every config not already in the traces file (saved after each, so an interrupted run resumes)."""
    from autotune.calibration.dit_memtrace import trace_dit_step

    stored = json.loads(traces_path.read_text()) if traces_path.is_file() else {}
    for cfg in configs:
        if _key(cfg) in stored:
            continue
        result = trace_dit_step(**cfg).to_dict()
        stored[_key(cfg)] = result
        traces_path.write_text(json.dumps(stored, indent=1, sort_keys=True))
        print(f"traced {cfg}: {result['peak_bytes'] / GIB:.2f} GiB in {result['seconds']} s", flush=True)
    return stored


TINY = "tiny-flux"
TINY_FIT = [dict(resolution=r, batch_size=1, rank=k, gradient_checkpointing=gc, optimizer="AdamW8bit",
                 fp8_base=False, blocks_to_swap=0) for gc in (True, False) for r in (128, 256) for k in (4, 16)]
TINY_FIT += [dict(resolution=256, batch_size=1, rank=4, gradient_checkpointing=gc, optimizer="AdamW8bit",
                  fp8_base=True, blocks_to_swap=0) for gc in (True, False)]


def tiny_variant() -> dict:
    """tiny-flux's own entry (the engine's tiny test twin: demos, CPU tests): its architecture and coefficients,
    traced on the engine's own model and LoRA network (a second or two in all)."""
    from autotune.calibration.dit_memtrace import dit_architecture_facts, trace_dit_step

    architecture = dit_architecture_facts(TINY)
    traces = {_key(cfg): trace_dit_step(TINY, **cfg, text_tokens=architecture["text_tokens"]).to_dict()
              for cfg in TINY_FIT}
    return {"architecture": architecture, **fit(traces, architecture, TINY_FIT)}


def _solve(rows: list[list[float]], rhs: list[float]) -> list[float]:
    import numpy as np

    return [float(x) for x in np.linalg.lstsq(np.array(rows), np.array(rhs), rcond=None)[0]]


def fit(traces: dict[str, dict], architecture: dict, configs: list[dict] | None = None) -> dict:
    """Activation coefficients per checkpointing setting (see the module doc)."""
    text = architecture["text_tokens"]
    out: dict = {"activations": {}, "fp8_extra": {}}
    for gc in (True, False):
        name = "gc" if gc else "no_gc"
        rows, rhs = [], []
        for cfg in configs or FIT:
            if cfg["gradient_checkpointing"] != gc or cfg["fp8_base"]:
                continue
            t = traces[_key(cfg)]
            tokens = cfg["batch_size"] * (get_family("flux-dev").image_tokens(cfg["resolution"]) + text)
            rows.append([1.0, cfg["rank"], tokens, tokens * cfg["rank"]])
            rhs.append(t["activations_peak_bytes"])
        c0, c1, a, b = _solve(rows, rhs)
        out["activations"][name] = {"c0": c0, "c1": c1, "a": a, "b": b}
        fp8 = next(c for c in configs or FIT if c["gradient_checkpointing"] == gc and c["fp8_base"])
        plain = dict(fp8, fp8_base=False)
        out["fp8_extra"][name] = (traces[_key(fp8)]["activations_peak_bytes"]
                                  - traces[_key(plain)]["activations_peak_bytes"])
    return out


def inputs_of(cfg: dict) -> DitMemoryInputs:
    return DitMemoryInputs(resolution=cfg["resolution"], batch_size=cfg["batch_size"], rank=cfg["rank"],
                            gradient_checkpointing=cfg["gradient_checkpointing"], optimizer=cfg["optimizer"],
                            fp8_base=cfg["fp8_base"], blocks_to_swap=cfg["blocks_to_swap"])


def table(traces: dict[str, dict], calibration: dict | None = None) -> list[str]:
    """Markdown rows: every validation trace against the model's tensor peak (the tracer's quantity)."""
    lines = ["| px | batch | rank | GC | optimizer | fp8 | swap | traced GiB | model GiB | model/trace |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for cfg in VALIDATION:
        traced = traces[_key(cfg)]["peak_bytes"]
        model = predict_dit_memory(inputs_of(cfg), calibration).tensor_peak_bytes
        lines.append(f"| {cfg['resolution']} | {cfg['batch_size']} | {cfg['rank']} | "
                     f"{'on' if cfg['gradient_checkpointing'] else 'off'} | {cfg['optimizer']} | "
                     f"{'on' if cfg['fp8_base'] else 'off'} | {cfg['blocks_to_swap']} | {traced / GIB:.2f} | "
                     f"{model / GIB:.2f} | {model / traced:.3f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", type=Path, default=ROOT / "bench" / "flux_traces.json")
    parser.add_argument("--table", action="store_true", help="print the table from the shipped calibration")
    args = parser.parse_args(argv)
    if args.table:
        calibration = json.loads(DIT_CALIBRATION_PATH.read_text())
        print("\n".join(table({_key(t["config"]): t for t in calibration["traces"]}, calibration)))
        return 0
    from autotune.calibration.dit_memtrace import dit_architecture_facts

    traces = collect(args.traces, FIT + VALIDATION)
    architecture = dit_architecture_facts()
    import torch

    from autotune.calibration.dit_memtrace import trace_text_encoder_caching

    caching = trace_text_encoder_caching()
    calibration = {
        "generated_by": "bench/calibrate_flux_memory.py", "torch": torch.__version__,
        "caching_transient_bytes": caching["transient_bytes"],
        "families": ["flux-dev", "flux-schnell", TINY], "architecture": architecture, **fit(traces, architecture),
        "variants": {TINY: tiny_variant()},
        "traces": [{"config": cfg, "peak_bytes": traces[_key(cfg)]["peak_bytes"],
                    "activations_peak_bytes": traces[_key(cfg)]["activations_peak_bytes"],
                    "seconds": traces[_key(cfg)]["seconds"], "used_for_fit": cfg in FIT}
                   for cfg in FIT + VALIDATION],
    }
    old = json.loads(DIT_CALIBRATION_PATH.read_text()) if DIT_CALIBRATION_PATH.is_file() else {}
    calibration = {**old, **calibration}  # keeps hand-kept sections (speed, host RAM) of the shipped file
    calibration["assumed"].pop("caching_transient_bytes", None)  # traced now
    DIT_CALIBRATION_PATH.write_text(json.dumps(calibration, indent=1, sort_keys=True) + "\n")
    print("\n".join(table(traces, calibration)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
