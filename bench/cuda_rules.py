"""The memory model against traces under CUDA autocast's op lists, before and after the re-fit, every family.

    .venv/bin/python bench/cuda_rules.py            # the table (from the shipped traces: no tracing, seconds)
    .venv/bin/python bench/cuda_rules.py --summary  # one row per family and checkpointing setting

The shipped calibrations hold, per family, the traces the fit did not use (other resolutions, batches, ranks,
optimizers, swap counts), traced under CUDA's op lists (``autotune.calibration.cuda_autocast``). "before" is the
model as fitted to traces under CPU autocast's lists (those coefficients are kept as each entry's ``cpu_rules``,
what a CPU plan reads), "after" the model re-fitted to the CUDA-rule traces, what a GPU plan reads. The rule the
re-fit holds: no held-out trace more than 2% above the model (model/trace >= 0.98).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GIB = 2**30


def unet_rows() -> list[tuple[str, bool, dict, float, float, float]]:
    """(family, checkpointing, config, traced GiB, before, after) of every held-out UNet trace."""
    from autotune.estimate.memory_model import load_calibration, predict_memory
    from bench.calibrate_memory import _inputs

    rows = []
    for trace in load_calibration()["traces"]:
        if trace["used_for_fit"]:
            continue
        cfg, peak = trace["config"], trace["peak_bytes"]
        before = predict_memory(_inputs(cfg, "cpu")).tensor_peak_bytes / peak
        after = predict_memory(_inputs(cfg, "cuda")).tensor_peak_bytes / peak
        rows.append((cfg["family"], cfg["gradient_checkpointing"], cfg, peak / GIB, before, after))
    return rows


def dit_rows() -> list[tuple[str, bool, dict, float, float, float]]:
    """The same for every transformer family's held-out traces."""
    from autotune.estimate.dit_memory import DitMemoryInputs, load_dit_calibration, predict_dit_memory

    calibration = load_dit_calibration()
    entries = {"flux-dev": calibration, **calibration["variants"]}
    rows = []
    for family, entry in entries.items():
        for trace in entry.get("traces", []):
            if trace["used_for_fit"]:
                continue
            cfg, peak = trace["config"], trace["peak_bytes"]
            inputs = DitMemoryInputs.of_trace(cfg, family)
            before = predict_dit_memory(replace(inputs, autocast_rules="cpu")).tensor_peak_bytes / peak
            after = predict_dit_memory(inputs).tensor_peak_bytes / peak
            rows.append((family, cfg["gradient_checkpointing"], cfg, peak / GIB, before, after))
    return rows


def _setting(cfg: dict) -> str:
    """The traced configuration in a few words: size, batch and rank, then what differs from the usual step."""
    words = [f"{cfg['resolution']}px", f"bs{cfg['batch_size']}", f"r{cfg['rank']}", cfg["optimizer"],
             cfg.get("weight_dtype", "")]
    if cfg.get("frames", 1) > 1:
        words.append(f"{cfg['frames']} frames")
    if cfg.get("fp8_base"):
        words.append("fp8")
    if cfg.get("blocks_to_swap"):
        words.append(f"swap {cfg['blocks_to_swap']}")
    if cfg.get("train_text_encoder"):
        words.append("TE trained")
    if not cfg.get("cache_latents", True):
        words.append("latents uncached")
    if cfg.get("attention", "sdpa") != "sdpa":
        words.append(f"{cfg['attention']} attention")
    return " ".join(w for w in words if w)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--summary", action="store_true", help="one row per family and checkpointing setting")
    args = parser.parse_args(argv)
    rows = unet_rows() + dit_rows()
    if args.summary:
        print("| family | GC | held-out traces | before: lowest .. highest model/trace | after: lowest .. highest |")
        print("|---|---|---|---|---|")
        groups: dict[tuple[str, bool], list[tuple[float, float]]] = {}
        for family, gc, _, _, before, after in rows:
            groups.setdefault((family, gc), []).append((before, after))
        for (family, gc), ratios in groups.items():
            b, a = [r[0] for r in ratios], [r[1] for r in ratios]
            print(f"| {family} | {'on' if gc else 'off'} | {len(ratios)} | {min(b):.3f} .. {max(b):.3f} | "
                  f"{min(a):.3f} .. {max(a):.3f} |")
    else:
        print("| family | GC | setting | traced GiB | before | after |")
        print("|---|---|---|---|---|---|")
        for family, gc, cfg, traced, before, after in rows:
            print(f"| {family} | {'on' if gc else 'off'} | {_setting(cfg)} | {traced:.2f} | {before:.3f} | "
                  f"{after:.3f} |")
    low = [(family, _setting(cfg), after) for family, _, cfg, _, _, after in rows if after < 0.98]
    print(f"\n{len(rows)} held-out traces; after the re-fit {len(low)} more than 2% above the model"
          + (f": {low}" if low else ""))
    return 1 if low else 0


if __name__ == "__main__":
    raise SystemExit(main())
