"""channels_last against contiguous on a CUDA GPU: is the engine's layout rule right on this card?

The engine stores a conv UNet's weights channels_last where ``sd_scripts_compat.training.devices.channels_last_for``
says so (tensor cores, fp16 / bf16). This check runs each family (default SDXL at 1024 px) at its plan for one
emulated card twice with ``bench/gpu_validate.py``'s case code, contiguous then channels_last, and prints s/step,
peak reserved memory and what the rule chose. Used by ``bench/gpu_validate.py`` (``--layout-check``); under
``--dry-run`` both layouts step the tiny twin at 64 px on the CPU (the code path, not the numbers).
"""

from __future__ import annotations

import time
from typing import Any

GIB = 1024**3
LAYOUTS = (("contiguous", False), ("channels_last", True))


def layout_rows(torch: Any, spec: Any, families: list[str], tier: float, goal: str, steps: int, warmup: int,
                dry_run: bool) -> list[dict[str, Any]]:
    from bench.gpu_compile_check import UNET_CASES
    from bench.gpu_validate import failed_case, make_plan, run_case
    from sd_scripts_compat.training.devices import channels_last_for

    rows = []
    for family in families:
        plan = make_plan(family, tier, spec, goal)
        s = plan.settings
        res = 64 if dry_run else UNET_CASES.get(family, s.resolution[0])
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(s.mixed_precision, torch.float32)
        row: dict[str, Any] = {"family": family, "tier_gb": tier, "case": "layout", "resolution": res,
                               "train_batch_size": s.train_batch_size, "mixed_precision": s.mixed_precision,
                               "rule": channels_last_for(torch.device("cpu" if dry_run else "cuda"), dtype, True)}
        if not plan.fits:
            row["would_measure"] = plan.message
            rows.append(row)
            continue
        for layout, flag in LAYOUTS:
            started = time.perf_counter()
            try:
                measured = run_case(torch, plan, f"tiny-{family}" if dry_run else family,
                                    "cpu" if dry_run else "cuda", tier, steps, warmup, resolution=res,
                                    channels_last=flag)
            except Exception as error:  # noqa: BLE001 - one broken case must not end the lease
                measured = failed_case(torch, error)
            measured["seconds"] = round(time.perf_counter() - started, 1)
            row[layout] = measured
            it = measured.get("measured_it_per_s")
            row[f"{layout}_s_per_micro_step"] = 1 / it if it else None
            print(f"{family} {layout}: {measured['seconds']} s, it/s {it}", flush=True)
        plain, nhwc = row["contiguous_s_per_micro_step"], row["channels_last_s_per_micro_step"]
        if plain and nhwc:
            row["channels_last_over_contiguous"] = nhwc / plain
            row["rule_right"] = row["rule"] == (nhwc < plain)
        rows.append(row)
    return rows


def print_layout_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'family':10} {'res':>5} {'mb':>3} {'prec':>5} {'contig s':>9} {'NHWC s':>8} {'NHWC/contig':>11} "
          f"{'peak GiB c/N':>13} {'rule':>14}")
    nan = float("nan")
    for r in rows:
        if "contiguous" not in r:
            print(f"{r['family']:10} {r.get('would_measure', '')}")
            continue
        peaks = "/".join(f"{r[k].get('measured_peak_reserved_bytes', nan) / GIB:.1f}" for k, _ in LAYOUTS)
        verdict = "" if "rule_right" not in r else (" (right)" if r["rule_right"] else " (WRONG)")
        plain, nhwc = r.get("contiguous_s_per_micro_step") or nan, r.get("channels_last_s_per_micro_step") or nan
        print(f"{r['family']:10} {r['resolution']:>5} {r['train_batch_size']:>3} {r['mixed_precision']:>5} "
              f"{plain:>9.3f} {nhwc:>8.3f} "
              f"{r.get('channels_last_over_contiguous', nan):>11.2f} {peaks:>13} "
              f"{('NHWC' if r['rule'] else 'contiguous') + verdict:>14}")
