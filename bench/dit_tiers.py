"""Transformer-family plans for 8-24 GB cards beside sd-scripts' published VRAM figures; prints a table.

    python bench/dit_tiers.py                                  # every DiT family sd-scripts trains
    python bench/dit_tiers.py --family flux-dev --rank 16 --gpu "RTX 3090"

Each row: the planner's choice for a card of that size with the named card's rates (resolution, micro-batch x
accumulation, rank, fp8 and its key, the text encoder's form while caching, swapped blocks) and its predictions
(peak VRAM, host RAM while training, seconds per micro-step, the swap's host-link seconds). Published figures
(sd-scripts' docs at the snapshot in ../shared/reference): FLUX.1 docs/flux_train_network.md 6.1 (all with
--fp8_base, cached text-encoder outputs, checkpointing); HunyuanImage-2.1 docs/hunyuan_image_train_network.md;
the SD3 doc's example swaps 32 blocks (no card named); Chroma, Lumina 2 and Anima publish none.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FAMILIES = ("flux-dev", "chroma", "sd3.5-medium", "sd3.5-large", "lumina2", "hunyuan-image-2.1", "anima")
TIERS = (8, 10, 12, 16, 24)
PUBLISHED = {
    "flux-dev": {24: "batch 2, no swap", 16: "batch 1 + some swap", 12: "swap 16, AdamW8bit",
                 10: "swap 22, fp8 T5", 8: "swap 28, fp8 T5"},
    "hunyuan-image-2.1": {24: "fp8_scaled, swap 9", 12: "fp8_scaled, swap 32", 8: "fp8_scaled, swap 37"},
    "sd3.5-large": {24: "doc example: swap 32 (no card named)"},
}
GIB = 2**30


def _text_encoders(values: dict) -> str:
    if values.get("text_encoder_cpu"):
        return "on the CPU"
    if values.get("fp8_vl") or "fp8" in str(values.get("t5xxl", "")):
        return "fp8"
    return "16-bit"


def rows(families: list[str], rank: int | None, gpu_name: str) -> list[str]:
    from autotune.estimate.dit_memory import dit_inputs_for_settings
    from autotune.estimate.dit_speed import swap_seconds
    from autotune.hardware.gpu_catalog import lookup_gpu
    from autotune.planning.dataset import nominal_dataset
    from autotune.planning.planner import PlanRequest, Preferences, plan_training
    from autotune.planning.request import gpu_from_spec

    spec = lookup_gpu(gpu_name)
    out = ["| family | GB | sd-scripts publishes | px | batch x accum | rank | fp8 | text encoders | swap "
           "| peak GiB | host RAM GiB | s / micro-step | swap link s |", "|" + "---|" * 13]
    for family in families:
        for tier in TIERS:
            published = PUBLISHED.get(family, {}).get(tier, "")
            plan = plan_training(PlanRequest(dataset_dir=None, model=f"./models/{family}.safetensors", family=family,
                                             gpus=(gpu_from_spec(spec, vram_gb=tier),), dataset=nominal_dataset(),
                                             cpu_physical_cores=8, preferences=Preferences(rank=rank)))
            if not plan.fits:
                out.append(f"| {family} | {tier} | {published} | does not fit | | | | | | | | | |")
                continue
            s, p, values = plan.settings, plan.prediction, plan.kohya_values()
            fp8 = next((k for k in ("fp8_base", "fp8_scaled") if values.get(k)), "no")
            inputs = dit_inputs_for_settings(family, s, t5_fp8=_text_encoders(values) == "fp8")
            out.append(f"| {family} | {tier} | {published} | {s.resolution[0]} | {s.train_batch_size} x "
                       f"{s.gradient_accumulation_steps} | {s.network_dim} | {fp8} | {_text_encoders(values)} | "
                       f"{s.blocks_to_swap} | {p.peak_bytes / GIB:.2f} | {p.ram_peak_bytes / GIB:.1f} | "
                       f"{1 / p.micro_steps_per_s:.2f} | {swap_seconds(inputs, spec):.2f} |")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", action="append", help="a DiT family (repeatable; default: all of them)")
    parser.add_argument("--rank", type=int, default=None, help="pin the rank (sd-scripts' examples use 16)")
    parser.add_argument("--gpu", default="RTX 3090", help="catalogue card whose rates the tiers use")
    args = parser.parse_args(argv)
    print("\n".join(rows(args.family or list(FAMILIES), args.rank, args.gpu)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
