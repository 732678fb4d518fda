"""Calibrate the transformer (DiT) memory model from fake-tensor traces of each full-size transformer
(``autotune.calibration.dit_memtrace``: the engine's modules and LoRA network); print traces vs model.

    python bench/calibrate_dit_memory.py                     # FLUX.1 (the file's top level) and tiny-flux
    python bench/calibrate_dit_memory.py --family sd3.5-large --family chroma ...   # a family's variants entry
    python bench/calibrate_dit_memory.py --table [--family F]  # only the table, from the shipped traces
    python bench/calibrate_dit_memory.py --rules cpu --family tiny-flux  # CPU autocast's coefficients (CPU plans)

Traces run under CUDA autocast's op lists by default (``--rules cuda``: ``autotune.calibration.cuda_autocast``;
layer_norm, softmax, exp and pow in fp32 as on a GPU): their coefficients are an entry's own, what GPU plans
read. ``--rules cpu`` traces under CPU autocast's lists and writes the entry's ``cpu_rules`` (what a CPU plan
reads), leaving the rest as it is; the traces of each rule set have their own folder.

Activation coefficients per checkpointing setting come from four traces each (512 / 1024 px x rank 16 / 64,
batch 1, AdamW8bit, bf16 weights): ``act = c0 + c1*rank + batch*tokens*(a + b*rank)`` with tokens = packed image
tokens + the 512 T5 tokens, solved exactly; ``fp8_extra`` from one fp8 trace each. The VALIDATION traces
(other resolutions, batches, optimizers, fp8 and swap counts) are not used by the fit: the table compares them.
The text-encoder caching transient (CLIP-L + T5-XXL forwards, no grad) is traced too.
Each trace takes ~20-60 s on this CPU; the traces file keeps them so a rerun only traces what is new.
tiny-flux (the engine's test twin) gets its own ``variants`` entry from traces of its own model (seconds).
FLUX.1-schnell shares dev's transformer and coefficients (its 256 T5 tokens make dev's 512 a slight over-estimate).

Every other transformer family (SD3.5 Medium / Large, Chroma, Lumina 2, HunyuanImage-2.1, Anima) gets a
``variants`` entry the same way, its configurations placed relative to its own native size and swap maximum
(:func:`family_fit`, :func:`family_validation`): 10 fit traces (native / 2 and native x rank 16 / 64 x
checkpointing, and batch 2 at native / 2: a per-sample constant ``d`` for what one more sample costs beside its
tokens, e.g. Anima's cross-attended text), an fp8 pair where the family stores fp8 (Anima does not), and 8
held-out traces with swap counts up to the family's maximum; its text-encoder caching transient is traced with
its own encoders. A family musubi-tuner trains adds batch 2 at native size, an fp8 pair at half size too
(``fp8_extra`` is the larger difference: the upcast weight's transient hides under a larger peak) and, for video,
clips of 49 frames at half size and 17 at native (x rank 16 / 64 x checkpointing), so the held-out clips of
17-81 frames stay inside the fitted token range.
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
    activation_tokens,
    predict_dit_memory,
)
from sd_scripts_compat.facts.families import get_family  # noqa: E402

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


def family_fit(family: str) -> list[dict]:
    """The fit configurations of a family: FIT's pattern at its native size and half of it."""
    spec = get_family(family)
    native, fp8 = spec.resolution, spec.fp8_option is not None
    out = [dict(resolution=r, batch_size=1, rank=k, gradient_checkpointing=gc, optimizer="AdamW8bit",
                fp8_base=False, blocks_to_swap=0) for gc in (True, False) for r in (native // 2, native)
           for k in (16, 64)]
    out += [dict(resolution=native // 2, batch_size=2, rank=16, gradient_checkpointing=gc, optimizer="AdamW8bit",
                 fp8_base=False, blocks_to_swap=0) for gc in (True, False)]  # what one more sample costs
    if spec.trainer == "musubi-tuner":  # batch 2 at native size too (the sample cost grows with its tokens)
        out += [dict(resolution=native, batch_size=2, rank=16, gradient_checkpointing=gc, optimizer="AdamW8bit",
                     fp8_base=False, blocks_to_swap=0) for gc in (True, False)]
    if (spec.musubi or {}).get("video"):  # clips of 49 frames at half size and 17 at native: 4-5x the tokens
        out += [dict(resolution=r, batch_size=1, rank=k, gradient_checkpointing=gc, optimizer="AdamW8bit",
                     fp8_base=False, blocks_to_swap=0, frames=f) for gc in (True, False)
                for r, f in ((native // 2, 49), (native, 17)) for k in (16, 64)]
    sizes = (native, native // 2) if spec.trainer == "musubi-tuner" else (native,)  # fp8's upcast transient
    return out + ([dict(resolution=r, batch_size=1, rank=16, gradient_checkpointing=gc, optimizer="AdamW8bit",
                        fp8_base=True, blocks_to_swap=0) for gc in (True, False) for r in sizes] if fp8 else [])


def family_validation(family: str) -> list[dict]:
    """Eight held-out configurations of a family: VALIDATION's pattern at its native size (and 1/2, 3/4 of it),
    swap counts from none to the family's maximum, fp8 only where the family has it."""
    spec = get_family(family)
    n, most, fp8 = spec.resolution, spec.max_blocks_to_swap, spec.fp8_option is not None
    rows = [(n, 2, 16, True, "AdamW8bit", True, most // 2), (n // 2, 2, 32, True, "AdamW", True, most),
            (n, 1, 16, False, "AdamW8bit", False, 0), (n // 2, 1, 32, False, "Adafactor", True, min(8, most)),
            (n, 1, 32, True, "Prodigy", False, most * 2 // 3), (n * 3 // 4, 1, 16, True, "AdamW8bit", True, most),
            (n // 2, 2, 16, False, "AdamW8bit", False, most // 3), (n, 2, 8, False, "AdamW8bit", True, 4)]
    out = [dict(resolution=r, batch_size=b, rank=k, gradient_checkpointing=gc, optimizer=o, fp8_base=f and fp8,
                blocks_to_swap=s) for r, b, k, gc, o, f, s in rows]
    if (spec.musubi or {}).get("video"):  # clips: 17, 33 and 81 frames (5, 9 and 21 latent frames)
        out += [dict(resolution=n // 2, batch_size=1, rank=32, gradient_checkpointing=True, optimizer="AdamW8bit",
                     fp8_base=fp8, blocks_to_swap=most // 2, frames=81),
                dict(resolution=n * 3 // 4, batch_size=1, rank=16, gradient_checkpointing=True, optimizer="AdamW",
                     fp8_base=fp8, blocks_to_swap=most, frames=33),
                dict(resolution=n // 2, batch_size=2, rank=16, gradient_checkpointing=False, optimizer="AdamW8bit",
                     fp8_base=False, blocks_to_swap=0, frames=17)]
    return out


def _key(cfg: dict) -> str:
    return json.dumps(cfg, sort_keys=True)


RULE_KEYS = ("activations", "fp8_extra", "caching_transient_bytes")  # what the autocast op lists change


def with_rules(old: dict, new: dict, rules: str) -> dict:
    """An entry with ``new`` fitted coefficients: under CUDA's rules they are the entry's own (its ``cpu_rules`` and
    what another script wrote, as ``latent_caching``, kept); under CPU's they become its ``cpu_rules``."""
    if rules == "cpu":
        return {**old, "cpu_rules": {key: new[key] for key in RULE_KEYS if key in new}}
    return {**old, **new}


def collect(traces_path: Path, configs: list[dict], family: str = "flux-dev", rules: str = "cuda") -> dict[str, dict]:
    """Trace every config not already in the traces file (saved after each, so an interrupted run resumes)."""
    from autotune.calibration.dit_memtrace import trace_dit_step

    stored = json.loads(traces_path.read_text()) if traces_path.is_file() else {}
    for cfg in configs:
        if _key(cfg) in stored:
            continue
        result = trace_dit_step(family, **cfg, autocast_rules=rules).to_dict()
        stored[_key(cfg)] = result
        traces_path.write_text(json.dumps(stored, indent=1, sort_keys=True))
        print(f"traced {cfg}: {result['peak_bytes'] / GIB:.2f} GiB in {result['seconds']} s", flush=True)
    return stored


TINY = "tiny-flux"
TINY_FIT = [dict(resolution=r, batch_size=1, rank=k, gradient_checkpointing=gc, optimizer="AdamW8bit",
                 fp8_base=False, blocks_to_swap=0) for gc in (True, False) for r in (128, 256) for k in (4, 16)]
TINY_FIT += [dict(resolution=256, batch_size=1, rank=4, gradient_checkpointing=gc, optimizer="AdamW8bit",
                  fp8_base=True, blocks_to_swap=0) for gc in (True, False)]


def tiny_variant(name: str = TINY, rules: str = "cuda") -> dict:
    """A tiny twin's own entry (tiny-flux, tiny-chroma: the engine's test models for demos and CPU tests): its
    architecture and coefficients, traced on the engine's own model and LoRA network (a second or two in all)."""
    from autotune.calibration.dit_memtrace import dit_architecture_facts, trace_dit_step

    architecture = dit_architecture_facts(name)
    traces = {_key(cfg): trace_dit_step(name, **cfg, text_tokens=architecture["text_tokens"],
                                        autocast_rules=rules).to_dict()
              for cfg in TINY_FIT}
    return {"architecture": architecture, **fit(traces, architecture, TINY_FIT, name)}


def _solve(rows: list[list[float]], rhs: list[float]) -> list[float]:
    import numpy as np

    return [float(x) for x in np.linalg.lstsq(np.array(rows), np.array(rhs), rcond=None)[0]]


def fit(traces: dict[str, dict], architecture: dict, configs: list[dict] | None = None,
        family: str = "flux-dev") -> dict:
    """Activation coefficients per checkpointing setting (see the module doc); ``fp8_extra`` 0 for a family
    without fp8 traces."""
    out: dict = {"activations": {}, "fp8_extra": {}}
    for gc in (True, False):
        name = "gc" if gc else "no_gc"
        chosen = [c for c in configs or FIT if c["gradient_checkpointing"] == gc and not c["fp8_base"]]
        per_sample = len({c["batch_size"] for c in chosen}) > 1  # batch-2 fit points: a per-sample constant d
        rows, rhs = [], []
        for cfg in chosen:
            batch = cfg["batch_size"]
            tokens = batch * activation_tokens(architecture, family, cfg["resolution"], frames=cfg.get("frames", 1))
            rows.append([1.0, cfg["rank"], tokens, tokens * cfg["rank"]] + ([batch] if per_sample else []))
            rhs.append(traces[_key(cfg)]["activations_peak_bytes"])
        c0, c1, a, b, *d = _solve(rows, rhs)
        out["activations"][name] = {"c0": c0, "c1": c1, "a": a, "b": b, **({"d": d[0]} if d else {})}
        # the largest traced difference: the upcast weight shows where it is not hidden under a larger peak
        out["fp8_extra"][name] = max((traces[_key(c)]["activations_peak_bytes"]
                                      - traces[_key(dict(c, fp8_base=False))]["activations_peak_bytes"]
                                      for c in configs or FIT if c["gradient_checkpointing"] == gc and c["fp8_base"]),
                                     default=0)
    return out


def inputs_of(cfg: dict, family: str = "flux-dev") -> DitMemoryInputs:
    return DitMemoryInputs.of_trace(cfg, family)


def table(traces: dict[str, dict], calibration: dict | None = None, family: str = "flux-dev",
          configs: list[dict] | None = None) -> list[str]:
    """Markdown rows: every validation trace against the model's tensor peak (the tracer's quantity)."""
    lines = ["| family | px | frames | batch | rank | GC | optimizer | fp8 | swap | traced GiB | model GiB "
             "| model/trace |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for cfg in configs or VALIDATION:
        traced = traces[_key(cfg)]["peak_bytes"]
        model = predict_dit_memory(inputs_of(cfg, family), calibration).tensor_peak_bytes
        lines.append(f"| {family} | {cfg['resolution']} | {cfg.get('frames', 1)} | {cfg['batch_size']} | "
                     f"{cfg['rank']} | "
                     f"{'on' if cfg['gradient_checkpointing'] else 'off'} | {cfg['optimizer']} | "
                     f"{'on' if cfg['fp8_base'] else 'off'} | {cfg['blocks_to_swap']} | {traced / GIB:.2f} | "
                     f"{model / GIB:.2f} | {model / traced:.3f} |")
    return lines


def _trace_rows(traces: dict[str, dict], fit_configs: list[dict], validation: list[dict]) -> list[dict]:
    return [{"config": cfg, "peak_bytes": traces[_key(cfg)]["peak_bytes"],
             "activations_peak_bytes": traces[_key(cfg)]["activations_peak_bytes"],
             "seconds": traces[_key(cfg)]["seconds"], "used_for_fit": cfg in fit_configs}
            for cfg in fit_configs + validation]


def family_variant(family: str, traces_path: Path, rules: str = "cuda") -> dict:
    """A transformer family's ``variants`` entry: its architecture, fit, caching transient and traces."""
    from autotune.calibration.dit_memtrace import dit_architecture_facts, trace_text_encoder_caching

    fit_configs, validation = family_fit(family), family_validation(family)
    traces = collect(traces_path, fit_configs + validation, family, rules)
    architecture = dit_architecture_facts(family)
    return {"architecture": architecture, **fit(traces, architecture, fit_configs, family),
            "caching_transient_bytes": trace_text_encoder_caching(family, autocast_rules=rules)["transient_bytes"],
            "traces": _trace_rows(traces, fit_configs, validation)}


def flux_calibration(traces_path: Path, rules: str = "cuda") -> dict:
    """FLUX.1's top-level entry (dev and schnell) and tiny-flux's variant."""
    import torch

    from autotune.calibration.dit_memtrace import dit_architecture_facts, trace_text_encoder_caching

    traces = collect(traces_path, FIT + VALIDATION, rules=rules)
    architecture = dit_architecture_facts()
    return {"generated_by": "bench/calibrate_dit_memory.py", "torch": torch.__version__,
            "caching_transient_bytes": trace_text_encoder_caching(autocast_rules=rules)["transient_bytes"],
            "architecture": architecture, **fit(traces, architecture), "traces": _trace_rows(traces, FIT, VALIDATION)}


def print_table(calibration: dict, families: list[str]) -> None:
    for family in (f for f in families if not get_family(f).tiny):  # a tiny twin keeps no held-out traces
        entry = calibration["variants"][family] if family in calibration["variants"] else calibration
        rows = [t for t in entry["traces"] if not t["used_for_fit"]]
        print("\n".join(table({_key(t["config"]): t for t in rows}, calibration, family, [t["config"] for t in rows])))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", action="append", default=[],
                        help="a transformer family other than FLUX.1 (repeatable); none: FLUX.1 and tiny-flux")
    parser.add_argument("--traces", type=Path, default=ROOT / "bench" / "results" / "dit_traces",
                        help="folder of the traces files (one per family and rule set), so a rerun only traces what "
                        "is new")
    parser.add_argument("--rules", choices=("cuda", "cpu"), default="cuda",
                        help="whose autocast op lists the traces follow (cpu: writes each entry's cpu_rules)")
    parser.add_argument("--table", action="store_true", help="print the table from the shipped calibration")
    args = parser.parse_args(argv)
    calibration = json.loads(DIT_CALIBRATION_PATH.read_text()) if DIT_CALIBRATION_PATH.is_file() else {}
    if args.table:
        print_table(calibration, args.family or ["flux-dev"])
        return 0
    folder = args.traces / args.rules
    folder.mkdir(parents=True, exist_ok=True)
    variants = dict(calibration.get("variants", {}))
    families = list(calibration.get("families", []))
    if not args.family:  # keeps hand-kept sections
        calibration = with_rules(calibration, flux_calibration(folder / "flux-dev.json", args.rules), args.rules)
        calibration.get("assumed", {}).pop("caching_transient_bytes", None)  # traced now
        variants[TINY] = with_rules(variants.get(TINY, {}), tiny_variant(rules=args.rules), args.rules)
        names = ["flux-dev", "flux-schnell", TINY]
    else:
        for family in args.family:
            new = tiny_variant(family, args.rules) if get_family(family).tiny else \
                family_variant(family, folder / f"{family}.json", args.rules)
            variants[family] = with_rules(variants.get(family, {}), new, args.rules)
        names = args.family
    calibration["variants"] = variants
    calibration["families"] = families + [name for name in names if name not in families]
    DIT_CALIBRATION_PATH.write_text(json.dumps(calibration, indent=1, sort_keys=True) + "\n")
    print_table(calibration, args.family or ["flux-dev"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
