"""Per-process peak of a sharded transformer step: the memory model against the engine's own sharding, traced.

Each row traces one LoRA step (:data:`SETTINGS`, cached inputs, bf16 weights) of the family's
full-size transformer on fake CPU tensors under CUDA autocast's op lists, sharded by our engine's ``fsdp``
(``training.sharding.shard_denoiser``: FSDP2 ``fully_shard`` per block, then the root) across N processes of torch's
fake process group, and sets the traced peak of one process beside the memory model's tensor peak for the same
settings (``dit_memory.predict_dit_memory(shard_ranks=N)``; the CUDA context, allocator overhead and margin are
the card's, not the trace's). "in flight" is what sharding adds to an unsharded step's activations: the traced
peak less the process's weights, LoRA, gradients, optimizer state and the unsharded trace's activations.

    .venv/bin/python bench/sharded_trace.py                       # FLUX.1 dev, SD3.5 Large, Chroma; 2 and 4
    .venv/bin/python bench/sharded_trace.py --families flux-dev --ranks 2
    .venv/bin/python bench/sharded_trace.py --offload                 # each process's share in host RAM
    .venv/bin/python bench/sharded_trace.py --fp8                     # Linear weights stored and gathered in fp8
    .venv/bin/python bench/sharded_trace.py --families sdxl sd15      # UNets: by ResNet and transformer block
    .venv/bin/python bench/sharded_trace.py --ranks 4 --hybrid 2      # hybrid_shard: groups of 2 of the 4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GIB = 2**30
# the plans' usual step, and one the memory fit did not use (another size, micro-batch, rank and optimizer)
SETTINGS: list[dict[str, Any]] = [{"resolution": 1024, "batch_size": 1, "rank": 16, "optimizer": "AdamW8bit"},
                                  {"resolution": 768, "batch_size": 2, "rank": 32, "optimizer": "AdamW"}]


def trace(family: str, settings: dict[str, Any], checkpointing: bool, ranks: int = 1, offload: bool = False,
          fp8: bool = False, hybrid: int | None = None) -> Any:
    """The traced step: a transformer family's (``trace_dit_step``) or a UNet's (``trace_training_step``, bf16)."""
    from autotune.calibration.dit_memtrace import trace_dit_step
    from autotune.calibration.memtrace import trace_training_step
    from sd_scripts_compat.facts.families import get_family

    if not get_family(family).transformer_block_groups:
        return trace_training_step(family, **settings, gradient_checkpointing=checkpointing, weight_dtype="bf16",
                                   shard_ranks=ranks, shard_size=hybrid)
    return trace_dit_step(family, **settings, gradient_checkpointing=checkpointing, shard_ranks=ranks,
                          shard_offload=offload, fp8_base=fp8, fsdp="hybrid_shard" if hybrid else "full_shard",
                          shard_size=hybrid)


def predict(family: str, settings: dict[str, Any], checkpointing: bool, ranks: int, offload: bool,
            fp8: bool = False) -> int:
    """The memory model's tensor peak for the same settings (``ranks``: those one copy is sharded across)."""
    from autotune.estimate.dit_memory import DitMemoryInputs, predict_dit_memory
    from autotune.estimate.memory_model import MemoryInputs, predict_memory
    from sd_scripts_compat.facts.families import get_family

    if not get_family(family).transformer_block_groups:
        return predict_memory(MemoryInputs(family=family, **settings, gradient_checkpointing=checkpointing,
                                           weight_dtype="bf16", shard_ranks=ranks)).tensor_peak_bytes
    return predict_dit_memory(DitMemoryInputs(family=family, **settings, gradient_checkpointing=checkpointing,
                                              fp8_base=fp8, shard_ranks=ranks,
                                              shard_offload=offload)).tensor_peak_bytes


def row(family: str, settings: dict[str, Any], ranks: int, checkpointing: bool,
        unsharded_activations: int, offload: bool = False, fp8: bool = False,
        hybrid: int | None = None) -> dict[str, Any]:
    """One traced and predicted sharded step (``offload``: each process's share in host RAM; ``fp8``: the frozen
    Linear weights in float8; ``hybrid``: sharded within groups of that many of the ``ranks``)."""
    traced = trace(family, settings, checkpointing, ranks, offload, fp8, hybrid)
    predicted = predict(family, settings, checkpointing, hybrid or ranks, offload, fp8)
    return {"family": family, "ranks": ranks, "gc": checkpointing, "held": traced.weights_bytes,
            "in_flight": traced.activations_peak_bytes - unsharded_activations, "traced": traced.peak_bytes,
            "predicted": predicted, "phase": traced.peak_phase, "seconds": traced.seconds}


def _at(family: str, settings: dict[str, Any]) -> dict[str, Any]:
    """The settings at the family's own size: SD 1.x / 2.x at half the side (512 px for 1024)."""
    from sd_scripts_compat.facts.families import get_family

    side = get_family(family).resolution
    return {**settings, "resolution": settings["resolution"] * side // 1024} if side < 1024 else settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=["flux-dev", "sd3.5-large", "chroma"])
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--offload", action="store_true", help="each process's share in host RAM "
                        "(fsdp_offload_params): the first setting, checkpointing on")
    parser.add_argument("--fp8", action="store_true", help="the frozen Linear weights stored and gathered in float8 "
                        "(fp8_base)")
    parser.add_argument("--hybrid", type=int, metavar="G", help="hybrid_shard: sharded within groups of G of the "
                        "processes (each --ranks a multiple of G, above it)")
    args = parser.parse_args(argv)

    print("| family | step | GC | processes | weights held GiB | in flight GiB | traced peak GiB | predicted GiB | "
          "predicted / traced | peak phase | trace s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    ratios = []
    for family in args.families:
        for settings in (SETTINGS[:1] if args.offload else SETTINGS):
            for checkpointing in ((True,) if args.offload else (True, False)):
                whole = trace(family, _at(family, settings), checkpointing, fp8=args.fp8)
                for ranks in args.ranks:
                    r = row(family, _at(family, settings), ranks, checkpointing, whole.activations_peak_bytes,
                            args.offload, args.fp8, args.hybrid)
                    ratios.append(r["predicted"] / r["traced"])
                    at = _at(family, settings)
                    step = f"{at['resolution']} px, {at['batch_size']} x rank {at['rank']}, {at['optimizer']}"
                    groups = f" (groups of {args.hybrid})" if args.hybrid else ""
                    print(f"| {family} | {step} | {'on' if checkpointing else 'off'} | {ranks}{groups} | "
                          f"{r['held'] / GIB:.2f} | {r['in_flight'] / GIB:.3f} | {r['traced'] / GIB:.2f} | "
                          f"{r['predicted'] / GIB:.2f} | {ratios[-1]:.3f} | {r['phase']} | {r['seconds']:.0f} |",
                          flush=True)
    low = [x for x in ratios if x < 0.98]
    print(f"\n{len(ratios)} sharded traces; predicted / traced {min(ratios):.3f} .. {max(ratios):.3f}; "
          f"{len(low)} more than 2% low")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
