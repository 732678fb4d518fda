"""The FLUX.1 half of ``bench/gpu_validate.py``: measured vs predicted peak VRAM and it/s at the planned swap counts.

For each emulated card (``torch.cuda.set_per_process_memory_fraction`` to the tier's size on the real GPU) it
plans FLUX.1-dev with ``autotune.planning.planner`` (the card's own rates, the tier's memory), builds the
full-size transformer from its config with random weights (nothing downloaded: 12 B parameters, filled on the
host in ~1 min), stores the Linear weights in fp8 when the plan says ``fp8_base``, swaps the planned
``blocks_to_swap`` with the engine's swapper (``sd_scripts_compat.training.block_swap``), applies the engine's
own kohya LoRA network (``autotune.calibration.dit_memtrace.engine_lora``) and runs warm-up + timed micro-steps
at the planned batch, resolution, checkpointing and optimizer on random cached latents / T5 / CLIP outputs.
Each case writes ``flux-dev_<tier>gb.json`` (measured ``max_memory_reserved`` / ``max_memory_allocated`` and
it/s against the predictions, or the OOM). ``--dry-run`` (any machine) only plans and prints what it would
measure: the 12 B model cannot step on a CPU.
"""

from __future__ import annotations

import time
from typing import Any

GIB = 1024**3
FAMILY = "flux-dev"
NOT_TENSORS = ("cuda_context", "allocator_overhead", "safety_margin", "swap_buffers")


def make_flux_plan(tier_gb: float, spec: Any, goal: str) -> Any:
    from autotune.planning.dataset import nominal_dataset
    from autotune.planning.planner import plan_training
    from autotune.planning.request import PlanRequest, gpu_from_spec

    target = gpu_from_spec(spec, vram_gb=tier_gb, name=f"{spec.name} limited to {tier_gb:g} GB")
    return plan_training(PlanRequest(dataset_dir=None, model=f"builtin:{FAMILY}", family=FAMILY, gpus=(target,),
                                     goal=goal, dataset=nominal_dataset(), cpu_physical_cores=8))


def planned_row(plan: Any, tier: float) -> dict[str, Any]:
    """What the case would measure against: the plan's settings and predictions."""
    p, s = plan.prediction, plan.settings
    components = dict(p.components)
    return {"family": FAMILY, "tier_gb": tier, "settings": plan.kohya_values(), "blocks_to_swap": s.blocks_to_swap,
            "predicted_peak_bytes": p.peak_bytes,
            "predicted_peak_without_context_bytes": p.peak_bytes - components.get("cuda_context", 0),
            "predicted_tensor_peak_bytes": sum(v for k, v in components.items() if k not in NOT_TENSORS),
            "predicted_components": components, "predicted_it_per_s": p.micro_steps_per_s,
            "predicted_host_ram_bytes": p.ram_peak_bytes, "usable_bytes": p.usable_bytes}


def _random_flux(torch: Any, fp8: bool) -> Any:
    """The engine's full-size FLUX.1 modules, the transformer with random weights on the host (N(0, 0.02))."""
    from autotune.calibration.dit_memtrace import build_bundle
    from sd_scripts_compat.models.families import get_family

    bundle = build_bundle(get_family("flux-dev"), materialize=True)
    if fp8:
        from sd_scripts_compat.training.precision import store_frozen_weights_in_fp8

        store_frozen_weights_in_fp8(bundle.unet, torch.bfloat16)
    return bundle


def _optimizer(torch: Any, name: str, params: list[Any]) -> Any:
    if name == "AdamW8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=1e-4)
    if name == "Prodigy":
        from prodigyopt import Prodigy

        return Prodigy(params, lr=1.0)
    return torch.optim.AdamW(params, lr=1e-4, fused=True)


def run_flux_case(torch: Any, plan: Any, tier: float, steps: int, warmup: int) -> dict[str, Any]:
    """Train at the plan's settings on the emulated card; measured peak memory and micro-steps/s."""
    from autotune.calibration.dit_memtrace import engine_lora
    from sd_scripts_compat.models.families import get_family
    from sd_scripts_compat.training.block_swap import enable_flux_block_swap, place_except_swapped

    flux = get_family("flux-dev")
    t5_tokens = flux.t5xxl_max_token_length or 512

    s = plan.settings
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, tier * GIB / total))
    bundle = _random_flux(torch, s.fp8_base)
    model = bundle.unet
    swap = enable_flux_block_swap(model, s.blocks_to_swap, "cuda", family=flux)
    place_except_swapped(model, swap, "cuda", torch.bfloat16)
    network = engine_lora(bundle, s.network_dim, float(s.network_alpha)).to("cuda")
    params = list(network.parameters())
    if s.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    model.train()
    opt = _optimizer(torch, s.optimizer_type, params)
    batch, tokens = s.train_batch_size, flux.image_tokens(s.resolution[0])
    side = s.resolution[0] // 16
    ids = torch.zeros(side * side, 3, device="cuda")
    txt_ids = torch.zeros(t5_tokens, 3, device="cuda")
    torch.cuda.reset_peak_memory_stats()
    times, oom = [], None
    try:
        for i in range(warmup + steps):
            torch.cuda.synchronize()
            started = time.perf_counter()
            latents = torch.randn(batch, tokens, 64, device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(hidden_states=latents.bfloat16(), timestep=torch.rand(batch, device="cuda"),
                             encoder_hidden_states=torch.randn(batch, t5_tokens, 4096, device="cuda").bfloat16(),
                             pooled_projections=torch.randn(batch, 768, device="cuda").bfloat16(), img_ids=ids,
                             txt_ids=txt_ids, guidance=torch.ones(batch, device="cuda"), return_dict=False)[0]
            pred.float().pow(2).mean().backward()
            if (i + 1) % s.gradient_accumulation_steps == 0:
                opt.step()
                opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - started)
    except torch.cuda.OutOfMemoryError as error:
        oom = str(error).splitlines()[0]
    measured = {"oom": oom is not None, "oom_message": oom, "timed_micro_steps": len(times),
                "measured_peak_reserved_bytes": torch.cuda.max_memory_reserved(),
                "measured_peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                "measured_it_per_s": (len(times) / sum(times)) if times else None}
    del model, bundle, opt, network, params, swap
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1.0)
    return measured


def flux_rows(torch: Any, spec: Any, tiers: list[float], goal: str, steps: int, warmup: int, dry_run: bool,
              write: Any, out: Any) -> list[dict[str, Any]]:
    """One row per tier: the plan, and (on a GPU) what the run measured against it."""
    rows = []
    for tier in tiers:
        plan = make_flux_plan(tier, spec, goal)
        if not plan.fits:
            rows.append({"family": FAMILY, "tier_gb": tier, "skipped": plan.message, "oom": False})
            continue
        row = planned_row(plan, tier)
        if dry_run:
            row.update({"dry_run": True, "oom": False, "would_measure": (
                f"{tier:g} GB: blocks_to_swap {plan.settings.blocks_to_swap}, micro-batch "
                f"{plan.settings.train_batch_size}, {plan.settings.resolution[0]} px, predicted "
                f"{row['predicted_peak_bytes'] / GIB:.2f} GiB peak, {row['predicted_it_per_s']:.3f} micro-steps/s, "
                f"{row['predicted_host_ram_bytes'] / GIB:.1f} GiB host RAM")})
            print(row["would_measure"], flush=True)
        else:
            started = time.perf_counter()
            row.update(run_flux_case(torch, plan, tier, steps, warmup))
            row["seconds"] = round(time.perf_counter() - started, 1)
            if row.get("measured_peak_reserved_bytes"):
                row["peak_ratio_measured_over_predicted"] = (row["measured_peak_reserved_bytes"]
                                                             / row["predicted_peak_without_context_bytes"])
            if row.get("measured_it_per_s"):
                row["speed_ratio_measured_over_predicted"] = row["measured_it_per_s"] / row["predicted_it_per_s"]
        write(out / f"{FAMILY}_{tier:g}gb.json", row)
        rows.append(row)
    return rows
