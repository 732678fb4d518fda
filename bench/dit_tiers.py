"""Transformer-family plans for 8-32 GB cards beside sd-scripts' and musubi-tuner's published VRAM figures.

    python bench/dit_tiers.py                                  # every DiT family sd-scripts trains
    python bench/dit_tiers.py --family flux-dev --rank 16 --gpu "RTX 3090"
    python bench/dit_tiers.py --musubi [--resolution 1024 --rank 16]   # the families musubi-tuner trains
    python bench/dit_tiers.py --musubi --family wan2.2-t2v-a14b --experts both --ram 64   # both Wan 2.2 experts

Each row: the planner's choice for a card of that size with the named card's rates (resolution, micro-batch x
accumulation, rank, fp8 and its key, the text encoder's form while caching, swapped blocks) and its predictions
(peak VRAM, host RAM while training, seconds per micro-step, the swap's host-link seconds). Published figures
(sd-scripts' docs at the snapshot in ../shared/reference): FLUX.1 docs/flux_train_network.md 6.1 (all with
--fp8_base, cached text-encoder outputs, checkpointing); HunyuanImage-2.1 docs/hunyuan_image_train_network.md;
the SD3 doc's example swaps 32 blocks (no card named); Chroma, Lumina 2 and Anima publish none. musubi-tuner
(docs at ../shared/reference's snapshot): docs/qwen_image.md's table (1024 px, batch 1, checkpointing), the FLUX.2
and Wan swap maxima and docs/wan.md's 24 GB sentence, README's 12 GB image / 24 GB video floors; the musubi
families plan 12-32 GB plus the sizes musubi publishes a figure for. With ``--ram`` the machine's RAM is known, so
the swap column also says where the planner pins the swapped blocks ("pinned") or offloads Wan 2.2's inactive
expert instead of swapping ("offload inactive expert").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sd_scripts_compat.facts.families import get_family

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FAMILIES = ("flux-dev", "chroma", "sd3.5-medium", "sd3.5-large", "lumina2", "hunyuan-image-2.1", "anima")
TIERS = (8, 10, 12, 16, 24)
MUSUBI_FAMILIES = ("qwen-image", "flux2-dev", "flux2-klein-4b", "flux2-klein-9b", "wan2.2-t2v-a14b",
                   "wan2.1-t2v-1.3b", "z-image")
MUSUBI_TIERS = (12, 16, 24, 32)
PUBLISHED = {
    "qwen-image": {42: "1024 px: no options", 30: "1024 px: fp8_base + fp8_scaled", 24: "1024 px: fp8 scaled, swap 16",
                   12: "1024 px: fp8 scaled, swap 45"},
    "flux2-dev": {12: "swap at most 29 (docs)"}, "flux2-klein-4b": {12: "swap at most 13 (docs)"},
    "flux2-klein-9b": {12: "swap at most 16 (docs)"},
    "wan2.2-t2v-a14b": {24: "720x1280 images with fp8 + swap (docs, no count)"},
    "wan2.1-t2v-1.3b": {12: "README: 12 GB+ for images"}, "z-image": {12: "swap at most 28 (docs)"},
    "flux-dev": {24: "batch 2, no swap", 16: "batch 1 + some swap", 12: "swap 16, AdamW8bit",
                 10: "swap 22, fp8 T5", 8: "swap 28, fp8 T5"},
    "hunyuan-image-2.1": {24: "fp8_scaled, swap 9", 12: "fp8_scaled, swap 32", 8: "fp8_scaled, swap 37"},
    "sd3.5-large": {24: "doc example: swap 32 (no card named)"},
}
GIB = 2**30


def _text_encoders(values: dict, family: str) -> str:
    from autotune.planning.profiles import plan_profile

    if values.get("text_encoder_cpu"):
        return "on the CPU"
    flag = plan_profile(get_family(family)).te_fp8_flag  # the family's fp8 text-encoder option (fp8_vl, fp8_t5, ...)
    if (flag and values.get(flag)) or "fp8" in str(values.get("t5xxl", "")):
        return "fp8"
    return "16-bit"


def rows(families: list[str], rank: int | None, gpu_name: str, resolution: int | None = None,
         frames: int | None = None, experts: str | None = None, ram_gb: float | None = None) -> list[str]:
    from autotune.estimate.dit_memory import dit_inputs_for_settings
    from autotune.estimate.dit_speed import swap_seconds
    from autotune.hardware.gpu_catalog import lookup_gpu
    from autotune.planning.dataset import nominal_dataset
    from autotune.planning.planner import PlanRequest, Preferences, plan_training
    from autotune.planning.profiles import plan_profile
    from autotune.planning.request import gpu_from_spec
    from sd_scripts_compat.facts.families import get_family

    spec = lookup_gpu(gpu_name)
    out = ["| family | GB | published | px | batch x accum | rank | GC | fp8 | text encoders | swap "
           "| peak GiB | host RAM GiB | s / micro-step | swap link s |", "|" + "---|" * 14]
    for family in families:
        musubi = family in MUSUBI_FAMILIES
        video = bool((get_family(family).musubi or {}).get("video"))
        tiers = sorted(set(MUSUBI_TIERS) | set(PUBLISHED.get(family, {}))) if musubi else TIERS
        for tier in tiers:
            published = PUBLISHED.get(family, {}).get(tier, "")
            plan = plan_training(PlanRequest(dataset_dir=None, model=f"./models/{family}.safetensors",
                                             family=get_family(family),
                                             gpus=(gpu_from_spec(spec, vram_gb=tier),), dataset=nominal_dataset(),
                                             cpu_physical_cores=8,
                                             host_ram_bytes=None if ram_gb is None else int(ram_gb * GIB),
                                             preferences=Preferences(
                                                 rank=rank, resolution=resolution, frames=frames if video else None,
                                                 experts=experts if plan_profile(get_family(family)).both_experts
                                                 else None)))
            if not plan.fits:
                out.append(f"| {family} | {tier} | {published} | does not fit | | | | | | | | | | |")
                continue
            s, p, values = plan.settings, plan.prediction, plan.kohya_values()
            fp8 = next((k for k in ("fp8_base", "fp8_scaled") if values.get(k)), "no")
            inputs = dit_inputs_for_settings(plan.family, s, t5_fp8=_text_encoders(values, family) == "fp8")
            size = f"{s.resolution[0]}" + (f" x {s.frames} frames" if s.frames > 1 else "")
            swap = f"{s.blocks_to_swap}" + (" pinned" if s.use_pinned_memory_for_block_swap else "") \
                + (" (offload inactive expert)" if s.offload_inactive_dit else "")
            name = family + (" (both experts)" if s.high_noise_expert else "")
            out.append(f"| {name} | {tier} | {published} | {size} | {s.train_batch_size} x "
                       f"{s.gradient_accumulation_steps} | {s.network_dim} | "
                       f"{'on' if s.gradient_checkpointing else 'off'} | {fp8} | {_text_encoders(values, family)} | "
                       f"{swap} | {p.peak_bytes / GIB:.2f} | {p.ram_peak_bytes / GIB:.1f} | "
                       f"{1 / p.micro_steps_per_s:.2f} | {swap_seconds(inputs, spec):.2f} |")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", action="append", help="a DiT family (repeatable; default: all of them)")
    parser.add_argument("--rank", type=int, default=None, help="pin the rank (sd-scripts' examples use 16)")
    parser.add_argument("--resolution", type=int, default=None, help="pin the resolution (musubi's Qwen table: 1024)")
    parser.add_argument("--musubi", action="store_true", help="the families musubi-tuner trains")
    parser.add_argument("--frames", type=int, default=None, help="clips of this many frames for the video families")
    parser.add_argument("--gpu", default="RTX 3090", help="catalogue card whose rates the tiers use")
    parser.add_argument("--experts", choices=("low", "both"), default=None, help="Wan 2.2: one expert or both")
    parser.add_argument("--ram", type=float, default=None, help="the machine's RAM in GB (pinning is decided then)")
    args = parser.parse_args(argv)
    families = args.family or list(MUSUBI_FAMILIES if args.musubi else FAMILIES)
    print("\n".join(rows(families, args.rank, args.gpu, args.resolution, args.frames, args.experts, args.ram)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
