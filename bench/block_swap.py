"""blocks_to_swap: seconds per LoRA step, peak device memory and bytes copied, swapped vs not, side by side.

A FLUX-shaped diffusers transformer (``--layers`` double, ``--single`` 2x single blocks, ``--width`` hidden),
LoRA rank 4 on every block Linear, AdamW, batch 1 at ``--tokens`` image tokens. Runs alternate between the
swap settings (``--swaps``, in sd-scripts' double-block units) so machine drift hits all alike; each row is
the median of ``--steps`` timed steps after 2 warm-up steps, its ratio against the first setting. On CUDA
peak memory is torch's allocator peak; on CPU the copies go to a staging buffer and memory is not shown.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/block_swap.py [--swaps 0,4,8] [--checkpointing] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any


def build(args: argparse.Namespace, swap_blocks: int, device: Any) -> tuple[Any, Any, list[Any]]:
    import torch
    from diffusers import FluxTransformer2DModel

    from sd_scripts_compat.network.lora import LoRAModule
    from sd_scripts_compat.training.block_swap import enable_flux_block_swap, place_except_swapped

    torch.manual_seed(0)
    heads = max(1, args.width // 64)
    model = FluxTransformer2DModel(in_channels=64, num_layers=args.layers, num_single_layers=2 * args.layers,
                                   attention_head_dim=args.width // heads, num_attention_heads=heads,
                                   joint_attention_dim=args.width, pooled_projection_dim=args.width,
                                   guidance_embeds=True, axes_dims_rope=(8, 28, 28) if args.width // heads == 64
                                   else (4, 6, 6))
    model.requires_grad_(False)
    swap = enable_flux_block_swap(model, swap_blocks, device)
    place_except_swapped(model, swap, device, torch.float32 if device.type == "cpu" else torch.bfloat16)
    if args.checkpointing:
        model.enable_gradient_checkpointing()
    loras = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and "blocks" in name:
            lora = LoRAModule(name, module, dim=4, alpha=4).to(device)
            lora.apply_to()
            loras.append(lora)
    return model, swap, loras


def run(args: argparse.Namespace, swap_blocks: int, device: Any) -> dict[str, float]:
    import torch

    from sd_scripts_compat.runtimes.flow_matching import flux_prediction

    model, swap, loras = build(args, swap_blocks, device)
    optimizer = torch.optim.AdamW([p for lora in loras for p in lora.parameters()], lr=1e-4)
    dtype = next(p.dtype for p in model.parameters() if p.device.type == device.type)
    side = int(args.tokens ** 0.5) * 2
    latents = torch.randn(1, 16, side, side, device=device, dtype=dtype)
    t5, pooled = torch.randn(1, 64, args.width, device=device, dtype=dtype), torch.randn(1, args.width, device=device,
                                                                                          dtype=dtype)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(args.steps + 2):
        start = time.perf_counter()
        out = flux_prediction(model, latents, torch.tensor([500.0], device=device), t5, pooled, None, 3.5)
        out.float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= 2:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else float("nan")
    copied = swap.stats.bytes_in / (args.steps + 2) / 2**20 if swap is not None else 0.0
    return {"s_per_step": statistics.median(times), "peak_mib": peak, "copied_mib_per_step": copied}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--swaps", default="0,2,4")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--device", default="cuda" if __import__("torch").cuda.is_available() else "cpu")
    args = parser.parse_args()
    import torch

    device = torch.device(args.device)
    swaps = [int(s) for s in args.swaps.split(",")]
    results: dict[int, list[dict[str, float]]] = {s: [] for s in swaps}
    for _ in range(args.repeats):
        for swap_blocks in swaps:
            results[swap_blocks].append(run(args, swap_blocks, device))
    base = statistics.median(r["s_per_step"] for r in results[swaps[0]])
    print(f"device {device}, {args.layers}+{2 * args.layers} blocks, width {args.width}, {args.tokens} tokens, "
          f"checkpointing {'on' if args.checkpointing else 'off'}")
    print("| blocks_to_swap | s/step | ratio | peak MiB | copied MiB/step |")
    print("|---|---|---|---|---|")
    for swap_blocks in swaps:
        rows = results[swap_blocks]
        seconds = statistics.median(r["s_per_step"] for r in rows)
        print(f"| {swap_blocks} | {seconds:.4f} | {seconds / base:.2f} | {max(r['peak_mib'] for r in rows):.0f} | "
              f"{rows[0]['copied_mib_per_step']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
