"""FLUX.1-dev plans for 8-24 GB cards side by side with sd-scripts' published VRAM tiers; prints a table.

    python bench/flux_tiers.py [--rank 16] [--gpu "RTX 3090"]

sd-scripts' docs (docs/flux_train_network.md 6.1, all with --fp8_base, cached text-encoder outputs and gradient
checkpointing): 24 GB batch 2; 16 GB batch 1 + some swap; 12 GB blocks_to_swap 16 + AdamW8bit; 10 GB swap 22, fp8
T5-XXL; 8 GB swap 28, fp8 T5-XXL. Each row: the planner's choice for a card of that size with the named card's
rates, the predicted peak, seconds per micro-step, and the swap's host-link seconds against the compute.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PUBLISHED = {24: "batch 2, no swap", 16: "batch 1 + some swap", 12: "swap 16, AdamW8bit", 10: "swap 22, fp8 T5",
             8: "swap 28, fp8 T5"}
GIB = 2**30


def rows(rank: int | None, gpu_name: str) -> list[str]:
    from autotune.estimate.dit_memory import dit_inputs_for_settings
    from autotune.estimate.dit_speed import dit_step_flops, swap_seconds
    from autotune.hardware.gpu_catalog import lookup_gpu
    from autotune.planning.dataset import nominal_dataset
    from autotune.planning.planner import PlanRequest, Preferences, plan_training
    from autotune.planning.request import gpu_from_spec

    spec = lookup_gpu(gpu_name)
    out = ["| GB | sd-scripts publishes | planned swap | micro-batch | rank | T5 file | predicted peak GiB "
           "| s / micro-step | swap link s / compute s |", "|---|---|---|---|---|---|---|---|---|"]
    for tier in sorted(PUBLISHED):
        plan = plan_training(PlanRequest(dataset_dir=None, model="./models/flux-dev.safetensors", family="flux-dev",
                                         gpus=(gpu_from_spec(spec, vram_gb=tier),), dataset=nominal_dataset(),
                                         cpu_physical_cores=8, preferences=Preferences(rank=rank)))
        if not plan.fits:
            out.append(f"| {tier} | {PUBLISHED[tier]} | does not fit: {plan.message} |")
            continue
        s, p = plan.settings, plan.prediction
        t5 = "fp8" if "fp8" in str(plan.kohya_values().get("t5xxl")) else "16-bit"
        inputs = dit_inputs_for_settings("flux-dev", s, t5_fp8=t5 == "fp8")
        tflop = dit_step_flops(inputs)["total"] / 1e12
        out.append(f"| {tier} | {PUBLISHED[tier]} | {s.blocks_to_swap} | {s.train_batch_size} | {s.network_dim} | "
                   f"{t5} | {p.peak_bytes / GIB:.2f} | {1 / p.micro_steps_per_s:.2f} | "
                   f"{swap_seconds(inputs, spec):.2f} / {1 / p.micro_steps_per_s:.2f} ({tflop:.0f} TFLOP) |")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=None, help="pin the rank (sd-scripts' example uses 16)")
    parser.add_argument("--gpu", default="RTX 3090", help="catalogue card whose rates the tiers use")
    args = parser.parse_args(argv)
    print("\n".join(rows(args.rank, args.gpu)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
