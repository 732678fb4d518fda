"""Time building / loading base models: full-size built-ins on the meta device, tiny ones on CPU,
and a tiny single-file save + load. Prints a table (median of a few runs, plus the first run,
which pays one-off costs such as imports and the family-shape memo).

    HF_HUB_OFFLINE=1 .venv/bin/python bench/load_models.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


def timed(fn: Callable[[], object], runs: int) -> tuple[float, float]:
    """(first run, median of the following runs) in seconds."""
    times = []
    for _ in range(runs + 1):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times[0], statistics.median(times[1:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()

    start = time.perf_counter()
    import torch

    from sd_scripts_compat.models.single_file import save_single_file
    from sd_scripts_compat.runtimes import load_base_model
    print(f"imports (torch, engine): {time.perf_counter() - start:.2f} s")
    torch.set_num_threads(max(1, torch.get_num_threads()))

    rows: list[tuple[str, str, float, float, str]] = []

    def add(what: str, device: str, fn: Callable[[], object], note: str = "") -> None:
        first, median = timed(fn, args.runs)
        rows.append((what, device, first, median, note))

    for name in ("sd15", "sd2", "sdxl"):
        bundle = load_base_model(f"builtin:{name}", device="meta")
        unet_m = sum(p.numel() for p in bundle.unet.parameters()) / 1e6
        te_m = sum(p.numel() for te in bundle.text_encoders for p in te.parameters()) / 1e6
        add(f"builtin:{name}", "meta", lambda n=name: load_base_model(f"builtin:{n}", device="meta"),
            f"UNet {unet_m:.2f} M, TE {te_m:.2f} M")
    for name in ("tiny-sd15", "tiny-sdxl"):
        add(f"builtin:{name}", "cpu", lambda n=name: load_base_model(f"builtin:{n}"))

    with tempfile.TemporaryDirectory() as tmp:
        for name in ("tiny-sd15", "tiny-sdxl"):
            bundle = load_base_model(f"builtin:{name}")
            path = Path(tmp) / f"{name}.safetensors"
            add(f"save_single_file {name}", "cpu", lambda b=bundle, p=path: save_single_file(b, p))
            size = path.stat().st_size / 2**20
            rows[-1] = (*rows[-1][:4], f"{size:.1f} MiB, fp32")
            add(f"load single file {name}", "cpu", lambda p=path: load_base_model(str(p)), f"{size:.1f} MiB")
            add(f"load single file {name}", "meta", lambda p=path: load_base_model(str(p), device="meta"),
                "header only")

    print(f"\n{'what':<32} {'device':<6} {'first s':>8} {'median s':>9}  note")
    for what, device, first, median, note in rows:
        print(f"{what:<32} {device:<6} {first:>8.3f} {median:>9.3f}  {note}")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\nmedian of {args.runs} runs after the first; torch threads {torch.get_num_threads()}, "
          f"{os.cpu_count()} CPUs, load average {load:.1f} (timings grow with a busy machine)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
