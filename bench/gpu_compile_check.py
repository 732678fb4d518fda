"""Compiled against eager on a CUDA GPU: s/step and model-FLOP utilisation (MFU) for SDXL at 1024 px and FLUX.1-dev,
each at its plan for one emulated card (``--compile-tier``, default 24 GB).

Each model runs twice with the same plan, random weights, LoRA network, checkpointing, swap and optimizer: eager,
then with the engine's ``torch_compile`` (``sd_scripts_compat.training.compiled_blocks.compile_blocks``: each repeated
block compiled, inductor). The eager run first counts one micro-step's FLOPs (forward + backward, ``FlopCounterMode``);
MFU is those FLOPs times the measured micro-steps per second over the card's dense bf16 rate from the GPU catalogue.
The compile time is the compiled warm-up's seconds beyond the eager warm-up's. Used by ``bench/gpu_validate.py``
(``--compile-check``); under ``--dry-run`` it plans both and prints what it would measure.
"""

from __future__ import annotations

import time
from typing import Any

GIB = 1024**3
UNET_CASES = {"sdxl": 1024}  # family -> the resolution measured (the "SDXL at 1024")


def compile_rows(torch: Any, spec: Any, families: list[str], tier: float, goal: str, steps: int, warmup: int,
                 dry_run: bool, backend: str = "inductor") -> list[dict[str, Any]]:
    from bench.gpu_validate import failed_case, make_plan, run_case
    from bench.gpu_validate_dit import make_dit_plan, run_dit_case

    rate = float(getattr(spec, "bf16_tensor_tflops", None) or spec.fp32_tflops) * 1e12
    rows = []
    for family in families:
        unet = family in UNET_CASES
        plan = make_plan(family, tier, spec, goal) if unet else make_dit_plan(family, tier, spec, goal)
        s = plan.settings
        res = UNET_CASES.get(family) or s.resolution[0]
        row: dict[str, Any] = {"family": family, "tier_gb": tier, "case": "compile", "resolution": res,
                               "train_batch_size": s.train_batch_size, "blocks_to_swap": s.blocks_to_swap,
                               "gradient_checkpointing": s.gradient_checkpointing, "fp8_base": s.fp8_base,
                               "peak_bf16_tflops": rate / 1e12}
        if not plan.fits or dry_run:
            row["would_measure"] = plan.message if not plan.fits else (
                f"{family} {tier:g} GB at {res} px, batch {s.train_batch_size}, swap {s.blocks_to_swap}: "
                f"eager then {backend}-compiled blocks, s/step and MFU")
            print(row["would_measure"], flush=True)
            rows.append(row)
            continue
        for side, compile_backend in (("eager", None), ("compiled", backend)):
            started = time.perf_counter()
            try:
                if unet:
                    measured = run_case(torch, plan, family, "cuda", tier, steps, warmup, resolution=res,
                                        compile_backend=compile_backend, count_flops=side == "eager")
                else:
                    measured = run_dit_case(torch, s, family, tier, steps, warmup, "cuda",
                                            compile_backend=compile_backend, count_flops=side == "eager")
            except Exception as error:  # noqa: BLE001 - one broken case must not end the lease
                measured = failed_case(torch, error)
            measured["seconds"] = round(time.perf_counter() - started, 1)
            row[side] = measured
            print(f"{family} {side}: {measured['seconds']} s, it/s {measured.get('measured_it_per_s')}", flush=True)
        _ratios(row, rate)
        rows.append(row)
    return rows


def _ratios(row: dict[str, Any], rate: float) -> None:
    eager, compiled = row["eager"], row["compiled"]
    flops = eager.get("flops_per_micro_step")
    for side in ("eager", "compiled"):
        it = row[side].get("measured_it_per_s")
        if it:
            row[f"{side}_s_per_micro_step"] = 1 / it
            if flops:
                row[f"{side}_mfu"] = flops * it / rate
    if eager.get("measured_it_per_s") and compiled.get("measured_it_per_s"):
        row["compiled_over_eager_s_per_step"] = eager["measured_it_per_s"] / compiled["measured_it_per_s"]
    if eager.get("warmup_seconds") is not None and compiled.get("warmup_seconds") is not None:
        row["compile_seconds"] = compiled["warmup_seconds"] - eager["warmup_seconds"]


def print_compile_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'family':10} {'res':>5} {'mb':>3} {'swap':>4} {'TFLOP/step':>10} {'eager s':>8} {'comp s':>8} "
          f"{'comp/eager':>10} {'MFU eager':>9} {'MFU comp':>9} {'compile s':>9}")
    for r in rows:
        if "eager" not in r:
            print(f"{r['family']:10} {r.get('would_measure', '')}")
            continue
        flops = r["eager"].get("flops_per_micro_step") or float("nan")
        nan = float("nan")
        print(f"{r['family']:10} {r['resolution']:>5} {r['train_batch_size']:>3} {r['blocks_to_swap']:>4} "
              f"{flops / 1e12:>10.2f} {r.get('eager_s_per_micro_step', nan):>8.3f} "
              f"{r.get('compiled_s_per_micro_step', nan):>8.3f} {r.get('compiled_over_eager_s_per_step', nan):>10.2f} "
              f"{r.get('eager_mfu', nan):>9.1%} {r.get('compiled_mfu', nan):>9.1%} "
              f"{r.get('compile_seconds', nan):>9.0f}")
