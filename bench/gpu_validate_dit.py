"""The transformer half of ``bench/gpu_validate.py``: measured vs predicted peak VRAM and it/s at the planned swap
counts, for every DiT family we plan (FLUX.1-dev, Chroma, SD3.5 Medium / Large, Lumina 2, HunyuanImage-2.1, Anima).

For each family and emulated card (``torch.cuda.set_per_process_memory_fraction`` to the tier's size on the real
GPU) it plans the full-size model with ``autotune.planning.planner`` (the card's own rates, the tier's memory),
builds its transformer from the family's config with random weights on the host (nothing downloaded; the calibration
module's ``build_bundle``), stores the Linear weights in fp8 under ``fp8_base``, swaps the planned ``blocks_to_swap``
with the engine's swapper (``sd_scripts_compat.training.block_swap``, the family's block groups), applies the
engine's kohya LoRA network and runs warm-up + timed micro-steps at the planned batch, resolution, checkpointing
and optimizer on random cached latents and text-encoder outputs, with the same forward the memory traces use
(``autotune.calibration.dit_memtrace.FORWARDS``). Each case writes ``<family>_<tier>gb.json``. For the families
sd-scripts trains (Lumina 2, HunyuanImage-2.1, Anima) the model and swap are diffusers' and ours, which the memory
model was calibrated on, not sd-scripts' own code. The same holds for the families musubi-tuner trains (Qwen-Image,
FLUX.2 dev / klein, Wan 2.1 / 2.2, Z-Image: ``--musubi``): their ``fp8_base`` is musubi's ``fp8_scaled`` as the
traces ran it (``dit_memtrace.musubi_fp8_scaled``: the bf16 copies each forward keeps), clips pass their planned
frames, and since our swapper adds two block buffers that musubi's in-place swap does not, the row's
``bench_swap_buffers_bytes`` is added to the prediction it is compared with.

``--dry-run`` (any machine) plans every case and prints what it would measure, and runs the very same case code
for real on the CPU with the tiny twins (tiny-flux, tiny-chroma, tiny-sd3) at 64 px: the full-size models cannot
step on a CPU.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from sd_scripts_compat.facts.families import get_family

GIB = 1024**3
NOT_TENSORS = ("cuda_context", "allocator_overhead", "safety_margin", "swap_buffers")
TINY_TWINS = {"flux-dev": "tiny-flux", "chroma": "tiny-chroma", "sd3.5-medium": "tiny-sd3",
              "sd3.5-large": "tiny-sd3"}
# the musubi families have no tiny twin: the dry run steps their own diffusers class at these small geometries
TINY_CONFIGS = {
    "QwenImageTransformer2DModel": {"num_layers": 2, "attention_head_dim": 32, "num_attention_heads": 2,
                                    "joint_attention_dim": 64, "axes_dims_rope": [8, 12, 12]},
    "Flux2Transformer2DModel": {"num_layers": 1, "num_single_layers": 2, "attention_head_dim": 32,
                                "num_attention_heads": 2, "joint_attention_dim": 64, "axes_dims_rope": [8, 8, 8, 8]},
    "WanTransformer3DModel": {"num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 32, "ffn_dim": 64,
                              "text_dim": 64},
    "ZImageTransformer2DModel": {"dim": 64, "n_layers": 2, "n_refiner_layers": 1, "n_heads": 2, "n_kv_heads": 2,
                                 "cap_feat_dim": 64, "axes_dims": [8, 12, 12]},
}
MUSUBI_FAMILIES = ("qwen-image", "flux2-klein-4b", "flux2-klein-9b", "z-image", "wan2.1-t2v-1.3b", "wan2.2-t2v-a14b",
                   "flux2-dev")


def make_dit_plan(family: str, tier_gb: float, spec: Any, goal: str) -> Any:
    from autotune.planning.dataset import nominal_dataset
    from autotune.planning.planner import plan_training
    from autotune.planning.request import PlanRequest, gpu_from_spec

    target = gpu_from_spec(spec, vram_gb=tier_gb, name=f"{spec.name} limited to {tier_gb:g} GB")
    return plan_training(PlanRequest(dataset_dir=None, model=f"builtin:{family}", family=get_family(family),
                                     gpus=(target,),
                                     goal=goal, dataset=nominal_dataset(), cpu_physical_cores=8))


def planned_row(plan: Any, family: str, tier: float) -> dict[str, Any]:
    """What the case would measure against: the plan's settings and predictions."""
    p, s = plan.prediction, plan.settings
    components = dict(p.components)
    return {"family": family, "tier_gb": tier, "settings": plan.kohya_values(), "blocks_to_swap": s.blocks_to_swap,
            "predicted_peak_bytes": p.peak_bytes,
            "predicted_peak_without_context_bytes": p.peak_bytes - components.get("cuda_context", 0),
            "predicted_tensor_peak_bytes": sum(v for k, v in components.items() if k not in NOT_TENSORS),
            "predicted_components": components, "predicted_it_per_s": p.micro_steps_per_s,
            "bench_swap_buffers_bytes": bench_swap_buffers(plan, family),
            "predicted_host_ram_bytes": p.ram_peak_bytes, "usable_bytes": p.usable_bytes}


def bench_swap_buffers(plan: Any, family: str) -> int:
    """What this bench's swapper (our engine's: two fresh block buffers) holds beyond a family whose trainer swaps
    in place (musubi-tuner's; the memory model gives its families none): compared against prediction + this."""
    from autotune.estimate.dit_memory import dit_family_calibration, swap_buffer_bytes
    from sd_scripts_compat.facts.families import get_family

    spec, s = get_family(family), plan.settings
    if spec.trained_here or not s.blocks_to_swap:
        return 0
    arch = dit_family_calibration(family)["architecture"]
    return swap_buffer_bytes(arch, s.fp8_base, spec.swap_split(s.blocks_to_swap))


def _optimizer(torch: Any, name: str, params: list[Any], cuda: bool) -> Any:
    if name == "AdamW8bit" and cuda:
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=1e-4)
    if name == "Prodigy":
        from prodigyopt import Prodigy

        return Prodigy(params, lr=1.0)
    return torch.optim.AdamW(params, lr=1e-4, fused=cuda)


def run_dit_case(torch: Any, settings: Any, family: str, tier: float, steps: int, warmup: int, device: str,
                 resolution: int | None = None, compile_backend: str | None = None,
                 count_flops: bool = False, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train ``family`` at ``settings`` for warmup + steps micro-steps on ``device``; measured peak memory (CUDA)
    and micro-steps/s. ``resolution`` overrides the planned one (the CPU dry run's tiny twins), ``config`` the
    denoiser's geometry (a musubi family's dry run); ``compile_backend`` compiles the repeated blocks as the
    engine's ``torch_compile`` does; ``count_flops`` counts one extra micro-step's FLOPs."""
    from autotune.calibration.dit_memtrace import (
        FORWARDS,
        build_bundle,
        enable_checkpointing,
        engine_lora,
        musubi_fp8_scaled,
        trace_family,
    )
    from sd_scripts_compat.training.block_swap import enable_flux_block_swap, place_except_swapped

    spec = trace_family(family, config)
    s, cuda = settings, device == "cuda"
    bundle = build_bundle(spec, materialize=True, device=device)  # drawn on the GPU: the host takes minutes
    model = bundle.unet
    if s.fp8_base and spec.trainer == "musubi-tuner":  # musubi's fp8_scaled, as the memory model's traces ran it
        musubi_fp8_scaled(model)
    elif s.fp8_base and cuda:
        from sd_scripts_compat.training.precision import store_frozen_weights_in_fp8

        store_frozen_weights_in_fp8(model, torch.bfloat16)
    if cuda:  # the swap wants the model on the host, the emulated card only the resident part
        model.to("cpu")
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, tier * GIB / total))
    swap = enable_flux_block_swap(model, s.blocks_to_swap, device, family=spec)
    place_except_swapped(model, swap, device, torch.bfloat16)
    network = engine_lora(bundle, s.network_dim, float(s.network_alpha)).to(device)
    params = list(network.parameters())
    if s.gradient_checkpointing and s.cpu_offload_checkpointing:
        from sd_scripts_compat.training.offload_checkpointing import offloaded_checkpoint

        model.enable_gradient_checkpointing(gradient_checkpointing_func=offloaded_checkpoint)
    elif s.gradient_checkpointing:
        enable_checkpointing(model)
    model.train()
    compiled = None
    if compile_backend:
        from sd_scripts_compat.training.compiled_blocks import compile_blocks

        compiled = compile_blocks(model, compile_backend)
    opt = _optimizer(torch, s.optimizer_type, params, cuda)
    forward, phases = FORWARDS[spec.denoiser_class], SimpleNamespace(phase="")  # no counting: real memory
    res = resolution or s.resolution[0]
    clip = {"frames": s.frames} if s.frames > 1 else {}
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    def micro_step() -> None:
        with torch.device(device):
            forward(model, phases, spec, s.train_batch_size, res, spec.denoiser_text_tokens, **clip)

    measured = _timed_steps(torch, micro_step, opt, cuda=cuda, warmup=warmup, steps=steps,
                            accum=s.gradient_accumulation_steps, count_flops=count_flops)
    if compiled is not None:
        from sd_scripts_compat.training.compiled_blocks import compile_summary

        measured["torch_compile"] = compile_summary(compiled)
    if cuda:
        measured.update({"measured_peak_reserved_bytes": torch.cuda.max_memory_reserved(),
                         "measured_peak_allocated_bytes": torch.cuda.max_memory_allocated()})
    model = None  # the closure's cell: the model goes with the rest
    del micro_step, bundle, opt, network, params, swap
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0)
    return measured


def _timed_steps(torch: Any, micro_step: Any, opt: Any, *, cuda: bool, warmup: int, steps: int, accum: int,
                 count_flops: bool) -> dict[str, Any]:
    """Warm-up, then timed micro-steps (the optimizer steps at each accumulation's end); an OOM is recorded."""
    times: list[float] = []
    oom, extra = None, {}
    began = time.perf_counter()
    try:
        if count_flops:
            from torch.utils.flop_counter import FlopCounterMode

            with FlopCounterMode(display=False) as counter:
                micro_step()
            opt.zero_grad(set_to_none=True)
            extra["flops_per_micro_step"] = counter.get_total_flops()
        for i in range(warmup + steps):
            if i == warmup:
                extra["warmup_seconds"] = time.perf_counter() - began
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            micro_step()
            if (i + 1) % accum == 0:
                opt.step()
                opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - started)
    except torch.OutOfMemoryError as error:
        oom = str(error).splitlines()[0]
    return {"oom": oom is not None, "oom_message": oom, "timed_micro_steps": len(times),
            "measured_it_per_s": (len(times) / sum(times)) if times else None, **extra}


def _dry_row(torch: Any, plan: Any, family: str, tier: float, row: dict[str, Any]) -> None:
    from sd_scripts_compat.facts.families import get_family

    s = plan.settings
    row.update({"dry_run": True, "oom": False, "would_measure": (
        f"{family} {tier:g} GB: blocks_to_swap {s.blocks_to_swap}, micro-batch {s.train_batch_size}, "
        f"{s.resolution[0]} px, fp8 {s.fp8_base}, predicted {row['predicted_peak_bytes'] / GIB:.2f} GiB peak, "
        f"{row['predicted_it_per_s']:.3f} micro-steps/s, {row['predicted_host_ram_bytes'] / GIB:.1f} GiB host RAM")})
    print(row["would_measure"], flush=True)
    tiny_config = TINY_CONFIGS.get(get_family(family).denoiser_class) if family in MUSUBI_FAMILIES else None
    if tiny_config is not None:  # the same case code on the family's own class, small, a block swapped at most
        from dataclasses import replace

        from autotune.calibration.dit_memtrace import trace_family

        most = min(1, trace_family(family, tiny_config).max_blocks_to_swap)
        small = replace(s, blocks_to_swap=min(s.blocks_to_swap, most), train_batch_size=1,
                        gradient_accumulation_steps=1, frames=min(s.frames, 5))
        tiny = run_dit_case(torch, small, family, tier, 2, 1, "cpu", resolution=64, config=tiny_config)
        row["dry_run_tiny"] = {"family": f"{family} (tiny geometry)", "blocks_to_swap": small.blocks_to_swap, **tiny}
    twin = TINY_TWINS.get(family)
    if twin:  # the same case code for real on the CPU, on the tiny twin (swap capped to its block count)
        from dataclasses import replace

        from sd_scripts_compat.facts.families import get_family

        swap = min(s.blocks_to_swap, get_family(twin).max_blocks_to_swap)
        tiny = run_dit_case(torch, replace(s, blocks_to_swap=swap, train_batch_size=1, gradient_accumulation_steps=1),
                            twin, tier, 2, 1, "cpu", resolution=64)
        row["dry_run_tiny"] = {"family": twin, "blocks_to_swap": swap, **tiny}


def offload_row(torch: Any, plan: Any, family: str, tier: float, steps: int, warmup: int, spec: Any,
                dry_run: bool) -> dict[str, Any]:
    """The plan's settings again with ``cpu_offload_checkpointing``: its own prediction, and on a GPU the
    measurement (the host copies run only on CUDA)."""
    from dataclasses import replace

    from autotune.estimate.dit_memory import dit_inputs_for_settings, predict_dit_memory
    from autotune.estimate.dit_speed import predict_dit_speed

    settings = replace(plan.settings, cpu_offload_checkpointing=True)
    inputs = dit_inputs_for_settings(plan.family, settings)
    memory = predict_dit_memory(inputs)
    row = {"family": family, "tier_gb": tier, "case": "cpu_offload_checkpointing", "settings": plan.kohya_values(),
           "predicted_peak_bytes": memory.total_bytes,
           "predicted_peak_without_context_bytes": memory.total_bytes - memory.components["cuda_context"],
           "predicted_activations_bytes": memory.components["activations"],
           "predicted_host_ram_bytes": memory.host_ram_bytes,
           "predicted_it_per_s": predict_dit_speed(inputs, spec).it_per_s, "oom": False}
    if dry_run:
        row["dry_run"] = True
        return row
    row.update(run_dit_case(torch, settings, family, tier, steps, warmup, "cuda"))
    if row.get("measured_peak_reserved_bytes"):
        row["peak_ratio_measured_over_predicted"] = (row["measured_peak_reserved_bytes"]
                                                     / row["predicted_peak_without_context_bytes"])
    return row


def dit_rows(torch: Any, spec: Any, families: list[str], tiers: list[float], goal: str, steps: int, warmup: int,
             dry_run: bool, write: Any, out: Any, budget_left: Any, offload: bool = True) -> list[dict[str, Any]]:
    """One row per family and tier: the plan, and (on a GPU) what the run measured against it; with ``offload``,
    the largest tier's checkpointed plan once more with ``cpu_offload_checkpointing``."""
    rows = []
    for family in families:
        for tier in tiers:
            if budget_left() <= 0:
                rows.append({"family": family, "tier_gb": tier, "skipped": "time budget spent"})
                continue
            plan = make_dit_plan(family, tier, spec, goal)
            if not plan.fits:
                rows.append({"family": family, "tier_gb": tier, "skipped": plan.message, "oom": False})
                continue
            row = planned_row(plan, family, tier)
            started = time.perf_counter()
            if dry_run:
                _dry_row(torch, plan, family, tier, row)
            else:
                try:
                    row.update(run_dit_case(torch, plan.settings, family, tier, steps, warmup, "cuda"))
                except Exception as error:  # noqa: BLE001 - one broken case must not end the lease
                    from bench.gpu_validate import failed_case

                    row.update(failed_case(torch, error))
                if row.get("measured_peak_reserved_bytes"):
                    row["peak_ratio_measured_over_predicted"] = row["measured_peak_reserved_bytes"] / (
                        row["predicted_peak_without_context_bytes"] + row["bench_swap_buffers_bytes"])
                if row.get("measured_it_per_s"):
                    row["speed_ratio_measured_over_predicted"] = row["measured_it_per_s"] / row["predicted_it_per_s"]
            row["seconds"] = round(time.perf_counter() - started, 1)
            write(out / f"{family}_{tier:g}gb.json", row)
            rows.append(row)
            if offload and tier == max(tiers) and plan.settings.gradient_checkpointing and \
                    not plan.settings.blocks_to_swap and budget_left() > 0:
                extra = offload_row(torch, plan, family, tier, steps, warmup, spec, dry_run)
                write(out / f"{family}_{tier:g}gb_offload.json", extra)
                rows.append(extra)
    return rows
