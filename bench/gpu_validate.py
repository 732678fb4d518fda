"""Check the planner's predictions on a real CUDA GPU: measured peak memory and it/s vs predicted.

For the built-in full-size SD1.5 and SDXL (random weights, nothing downloaded) and emulated cards of
8 / 12 / 16 / 24 GB (``torch.cuda.set_per_process_memory_fraction`` on the real card), it plans with
``autotune.planning.planner`` (the card's own rates, the emulated memory), then runs a short training at exactly the
planned settings: our kohya LoRA network (``sd_scripts_compat.network.lora.create_network``) on the UNet (and the
text encoder when the plan trains it), random cached latents and text embeddings, the planned micro-batch,
gradient accumulation, checkpointing, optimizer, precision and fp8 storage. A direct step loop instead of
the full trainer: no dataset, no VAE and no caching pass, so one case takes seconds.

Each case records measured peak (``torch.cuda.max_memory_reserved``, what the allocator held; the CUDA
context lies outside it and is subtracted from the prediction), ``max_memory_allocated`` against the
predicted tensor peak, measured it/s (micro-steps, i.e. forward + backward passes, per second) against
predicted, and any OOM. One JSON per case plus
``summary.json`` go to the folder given on the command line (default ``$OUT``, else
``bench/results/gpu_validate``); a table is printed. Total well under 8 minutes on one H100/H200.

``--dry-run`` runs the same code on the CPU with the tiny twins (tiny-sd15, tiny-sdxl) at 64 px, two
steps per case: it proves the script end to end on a machine without a GPU (memory is not measured).

The transformer families (``--dit-families``, default FLUX.1-dev, Chroma, SD3.5 Medium / Large, Lumina 2,
HunyuanImage-2.1, Anima; ``--dit-tiers``, default 8,12,16,24 GB; ``bench/gpu_validate_dit.py``): the full-size
transformer at the planned swap counts on emulated cards; under ``--dry-run`` it prints the plan of what it would
measure and runs the same case code on the CPU with the tiny twins. ``--budget`` stops starting cases after so many
seconds (the rest are listed as skipped): on a 15-minute device lease run the DiT families in a call of their own.
``--layout-check`` (default SDXL at 1024 at the same plan) runs each layout, contiguous and channels_last, and says
whether the engine's rule chose the faster one (``bench/gpu_layout_check.py``). ``--compile-check`` (default SDXL at
1024 and FLUX.1-dev, at the ``--compile-tier`` plan) runs last: each eager,
then with the engine's compiled blocks, with s/step and model-FLOP utilisation (``bench/gpu_compile_check.py``). On
the lent H200 (2026-12-04) inductor had not finished compiling SDXL's blocks after 460 s: give it a call of its own.
On a machine with two or more GPUs it ends with ``bench/gpu_sharding_check.py`` (the link between the cards against
the planner's, and our engine sharded against unsharded on NCCL).

    python bench/gpu_validate.py "$OUT"            # on a CUDA machine
    python bench/gpu_validate.py --musubi "$OUT"   # the musubi-tuner families, in a call of their own
    python bench/gpu_validate.py --dry-run /tmp/gv  # anywhere
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GIB = 1024**3
CONTEXT_KEYS = ("cuda_context",)  # memory-model component that lives outside the caching allocator
NOT_TENSORS = ("cuda_context", "allocator_overhead", "safety_margin", "ddp_buckets")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default=None, help="result folder (default: $OUT or bench/results/...)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny models, 2 steps: test the script itself")
    parser.add_argument("--families", default="sd15,sdxl", help="comma-separated built-in UNet families")
    parser.add_argument("--dit-families", default="flux-dev,chroma,sd3.5-medium,sd3.5-large,lumina2,"
                        "hunyuan-image-2.1,anima", help="comma-separated transformer families ('' for none)")
    parser.add_argument("--tiers", default="8,12,16,24", help="emulated card sizes in GB")
    parser.add_argument("--steps", type=int, default=None, help="timed micro-steps per case (default 8; dry-run 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed micro-steps first (default 3; dry-run 1)")
    parser.add_argument("--budget", type=float, default=420.0, help="stop starting new cases after this many s")
    parser.add_argument("--goal", default="character")
    parser.add_argument("--dit-tiers", default="8,12,16,24",
                        help="emulated card sizes for the transformer families (bench/gpu_validate_dit.py)")
    parser.add_argument("--musubi", action="store_true",
                        help="the families musubi-tuner trains instead (no UNet families, no compile check): "
                        "Qwen-Image, FLUX.2 klein / dev, Z-Image, Wan at 12-32 GB (--dit-families/--dit-tiers narrow)")
    parser.add_argument("--compile-check", default="sdxl,flux-dev",
                        help="families measured eager and compiled, with MFU (bench/gpu_compile_check.py; '' for none)")
    parser.add_argument("--compile-tier", type=float, default=24.0, help="emulated card of the compile check, GB")
    parser.add_argument("--layout-check", default="sdxl",
                        help="UNet families measured contiguous and channels_last at the compile tier's plan "
                        "(bench/gpu_layout_check.py; '' for none)")
    args = parser.parse_args(argv)
    if args.musubi:
        from bench.gpu_validate_dit import MUSUBI_FAMILIES

        defaults = {"dit_families": parser.get_default("dit_families"), "dit_tiers": parser.get_default("dit_tiers")}
        args.families, args.compile_check, args.layout_check = "", "", ""
        if args.dit_families == defaults["dit_families"]:
            args.dit_families = ",".join(MUSUBI_FAMILIES)
        if args.dit_tiers == defaults["dit_tiers"]:
            args.dit_tiers = "12,16,24,32"
    return args


def result_dir(arg: str | None) -> Path:
    out = Path(arg or os.environ.get("OUT") or ROOT / "bench" / "results" / "gpu_validate")
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def device_spec(torch: Any, dry_run: bool) -> Any:
    """The catalogue entry of this GPU (its rates feed the speed prediction); the generic card otherwise."""
    from autotune.hardware.gpu_catalog import find_gpu, lookup_gpu
    from autotune.planning.request import GENERIC_GPU_NAME

    if not dry_run and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory / GIB
        spec = find_gpu(torch.cuda.get_device_name(0), vram_gb=total) or find_gpu(torch.cuda.get_device_name(0))
        if spec is not None:
            return spec
    return lookup_gpu(GENERIC_GPU_NAME)


def make_plan(family: str, tier_gb: float, spec: Any, goal: str) -> Any:
    from autotune.planning.dataset import nominal_dataset
    from autotune.planning.planner import plan_training
    from autotune.planning.request import PlanRequest, gpu_from_spec

    target = gpu_from_spec(spec, vram_gb=tier_gb, name=f"{spec.name} limited to {tier_gb:g} GB")
    return plan_training(PlanRequest(dataset_dir=None, model=f"builtin:{family}", gpus=(target,), goal=goal,
                                     dataset=nominal_dataset(), cpu_physical_cores=8))


def run_case(torch: Any, plan: Any, train_family: str, device: str, tier_gb: float, steps: int, warmup: int,
             resolution: int | None, compile_backend: str | None = None, count_flops: bool = False,
             channels_last: bool | None = None) -> dict[str, Any]:
    """Train at the plan's settings for warmup + steps micro-steps; measure memory and speed. ``compile_backend``
    compiles the UNet's repeated blocks as the engine's ``torch_compile`` does (the warm-up holds the compile);
    ``count_flops`` counts one extra micro-step's FLOPs (forward + backward) for the model-FLOP utilisation;
    ``channels_last`` forces the UNet's weight layout (None: the engine's rule, ``channels_last_for``)."""
    from sd_scripts_compat.facts.families import get_family

    s = plan.settings
    family = get_family(train_family)
    cuda = device == "cuda"
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(s.mixed_precision) if cuda else None
    # CPU: fp32 (the dry run checks the code path, not the numbers)
    if cuda:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
    case = _build_case(torch, plan, family, device, amp_dtype or torch.float32, compile_backend, channels_last)
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, tier_gb * GIB / total), 0)
        torch.cuda.reset_peak_memory_stats(0)
    baseline_reserved = torch.cuda.memory_reserved(0) if cuda else 0
    micro_step = _micro_step(torch, case, family, s, resolution or s.resolution[0], device, amp_dtype)
    record: dict[str, Any] = {"oom": False, "error": None, "channels_last": case["channels_last"]}
    _time_micro_steps(torch, micro_step, record, cuda=cuda, warmup=warmup, steps=steps,
                      accum=s.gradient_accumulation_steps, count_flops=count_flops)
    if case["compiled"] is not None:
        from sd_scripts_compat.training.compiled_blocks import compile_summary

        record["torch_compile"] = compile_summary(case["compiled"])
    if cuda:
        record["measured_peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved(0))
        record["measured_peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated(0))
        record["baseline_reserved_bytes"] = int(baseline_reserved)
    case.clear()  # drop the model, network and optimizer before the next case
    del micro_step
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
    return record


def _build_case(torch: Any, plan: Any, family: Any, device: str, weight_dtype: Any, compile_backend: str | None,
                channels_last: bool | None) -> dict[str, Any]:
    """The UNet (and trained text encoders) at the plan's precision, fp8 base, checkpointing and layout, its LoRA
    and optimizer: one mutable holder, so the step closure sees the objects and cleanup drops them at once."""
    from sd_scripts_compat.models.build import build_modules
    from sd_scripts_compat.network.lora import create_network
    from sd_scripts_compat.training.devices import channels_last_for, to_channels_last
    from sd_scripts_compat.training.optim import make_optimizer
    from sd_scripts_compat.training.precision import store_frozen_weights_in_fp8

    s, cuda = plan.settings, device == "cuda"
    bundle = build_modules(family, device=device, dtype=None, seed=0)
    bundle.vae = None  # latents are cached: kohya moves the VAE off the GPU
    if s.cache_text_encoder_outputs:
        bundle.text_encoders = []
    unet = bundle.unet.to(weight_dtype)
    text_encoders = [te.to(weight_dtype) for te in bundle.text_encoders]
    train_te = not s.network_train_unet_only
    if s.fp8_base and cuda:
        store_frozen_weights_in_fp8(unet, weight_dtype)
    if s.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
        for te in text_encoders if train_te else []:
            te.gradient_checkpointing_enable()
    network = create_network(bundle, network_dim=s.network_dim, network_alpha=float(s.network_alpha),
                             train_text_encoder=train_te)
    network.to(device)
    network.apply_to()
    if channels_last is None:
        channels_last = channels_last_for(torch.device(device), weight_dtype, conv_unet=True)
    if channels_last:
        to_channels_last(unet)
    compiled = None
    if compile_backend:
        from sd_scripts_compat.training.compiled_blocks import compile_blocks

        compiled = compile_blocks(unet, compile_backend)
    values = plan.kohya_values()
    te_lr = values.get("text_encoder_lr", [None])[0]
    groups = network.prepare_optimizer_params(te_lr, values["unet_lr"], values["learning_rate"])
    optimizer_args = dict(item.split("=", 1) for item in values.get("optimizer_args", []))
    optimizer_args = {k: _literal(v) for k, v in optimizer_args.items()}
    optimizer, _ = make_optimizer(s.optimizer_type, groups, values["learning_rate"], optimizer_args)
    return {"unet": unet, "text_encoders": text_encoders, "optimizer": optimizer, "network": network,
            "bundle": bundle, "train_te": train_te, "weight_dtype": weight_dtype, "compiled": compiled,
            "channels_last": bool(channels_last)}


def _micro_step(torch: Any, case: dict[str, Any], family: Any, s: Any, res: int, device: str,
                amp_dtype: Any) -> Callable[[int], None]:
    """One micro-step on random latents and conditioning (the optimizer steps at each accumulation's end)."""
    import torch.nn.functional as F

    mb, accum, weight_dtype = s.train_batch_size, s.gradient_accumulation_steps, case["weight_dtype"]
    latent = res // 8
    cross = family.unet["cross_attention_dim"]
    generator = torch.Generator(device="cpu").manual_seed(0)
    scaler = torch.amp.GradScaler("cuda") if device == "cuda" and amp_dtype == torch.float16 else None

    def micro_step(i: int) -> None:
        lat = torch.randn(mb, 4, latent, latent, generator=generator).to(device)
        noise = torch.randn(mb, 4, latent, latent, generator=generator).to(device)
        timesteps = torch.randint(0, 1000, (mb,), generator=generator).to(device)
        with torch.autocast(device_type=device, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            text_encoders = case["text_encoders"]
            if case["train_te"] and text_encoders:
                vocab = int(text_encoders[0].config.vocab_size)
                ids = torch.randint(0, vocab - 1, (mb, 77), generator=generator).to(device)
                states = [te(ids, output_hidden_states=True).hidden_states[-2] for te in text_encoders]
                cond = torch.cat(states, dim=-1)
                if cond.shape[-1] != cross:
                    cond = cond[..., :cross]
            else:
                cond = torch.randn(mb, 77, cross, generator=generator).to(device, weight_dtype)
            kwargs: dict[str, Any] = {}
            if family.is_sdxl:
                pooled = (family.unet["projection_class_embeddings_input_dim"]
                          - 6 * family.unet["addition_time_embed_dim"])
                kwargs["added_cond_kwargs"] = {
                    "text_embeds": torch.randn(mb, pooled, generator=generator).to(device, weight_dtype),
                    "time_ids": torch.tensor([[res, res, 0, 0, res, res]] * mb, device=device, dtype=weight_dtype),
                }
            pred = case["unet"]((lat + noise).to(weight_dtype), timesteps, cond, **kwargs).sample
            loss = F.mse_loss(pred.float(), noise.float()) / accum
        if scaler is not None:
            scaler.scale(loss).backward()
        else:
            loss.backward()
        if (i + 1) % accum == 0:
            if scaler is not None:
                scaler.step(case["optimizer"])
                scaler.update()
            else:
                case["optimizer"].step()
            case["optimizer"].zero_grad(set_to_none=True)

    return micro_step


def _time_micro_steps(torch: Any, micro_step: Callable[[int], None], record: dict[str, Any], *, cuda: bool,
                      warmup: int, steps: int, accum: int, count_flops: bool) -> None:
    """Warm-up, then whole optimizer steps timed into ``record`` (an OOM is recorded, not raised)."""
    timed = 0
    start = None
    began = time.perf_counter()
    try:
        if count_flops:
            from torch.utils.flop_counter import FlopCounterMode

            with FlopCounterMode(display=False) as counter:
                micro_step(accum - 1)  # a whole accumulation's last micro-step: its optimizer step holds no FLOPs
            record["flops_per_micro_step"] = counter.get_total_flops()
        # round the timed part up to whole optimizer steps so every timed micro-step has the same mix
        total_steps = warmup + max(accum, steps // accum * accum)
        for i in range(total_steps):
            if i == warmup:
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                record["warmup_seconds"] = start - began
            micro_step(i)
            if i >= warmup:
                timed += 1
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start if start is not None else 0.0
        record["measured_it_per_s"] = timed / elapsed if elapsed > 0 else None
    except torch.OutOfMemoryError as error:
        record["oom"] = True
        record["error"] = str(error).splitlines()[0][:300]
        record["measured_it_per_s"] = None
    record["timed_micro_steps"] = timed


def failed_case(torch: Any, error: BaseException) -> dict[str, Any]:
    """The record of a case that raised: its error in one line; the GPU freed for the next case."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
    print(f"case failed: {type(error).__name__}: {error}"[:400], flush=True)
    return {"oom": False, "error": f"{type(error).__name__}: {error}"[:400]}


def _literal(text: str) -> Any:
    import ast

    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def summarize(plan: Any, measured: dict[str, Any], family: str, tier: float) -> dict[str, Any]:
    p = plan.prediction
    components = dict(p.components)
    context = sum(v for k, v in components.items() if k in CONTEXT_KEYS)
    predicted_allocator = p.peak_bytes - context  # the peak excludes the safety margin already
    tensor_peak = sum(v for k, v in components.items() if k not in NOT_TENSORS)
    row: dict[str, Any] = {
        "family": family, "tier_gb": tier, "settings": plan.kohya_values(),
        "predicted_peak_bytes": p.peak_bytes, "predicted_components": components,
        "predicted_peak_without_context_bytes": predicted_allocator, "predicted_tensor_peak_bytes": tensor_peak,
        "predicted_it_per_s": p.micro_steps_per_s, "usable_bytes": p.usable_bytes, **measured,
    }
    reserved = measured.get("measured_peak_reserved_bytes")
    if reserved:
        row["peak_ratio_measured_over_predicted"] = reserved / predicted_allocator
        row["allocated_ratio_measured_over_predicted"] = measured["measured_peak_allocated_bytes"] / tensor_peak
    if measured.get("measured_it_per_s"):
        row["speed_ratio_measured_over_predicted"] = measured["measured_it_per_s"] / p.micro_steps_per_s
    return row


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'family':17} {'GB':>4} {'mb':>3} {'ga':>3} {'gc':>3} {'res':>5} {'rank':>4} {'opt':>10} "
            f"{'pred GiB':>8} {'meas GiB':>8} {'ratio':>6} {'pred it/s':>9} {'meas it/s':>9} {'ratio':>6} oom")
    print(head)
    for r in rows:
        if r.get("skipped") or r.get("would_measure") or r.get("case"):
            said = r.get("skipped") or r.get("would_measure") or (
                f"{r['case']}: predicted {r['predicted_peak_bytes'] / GIB:.2f} GiB peak "
                f"({r['predicted_peak_without_context_bytes'] / GIB:.2f} without the CUDA context), measured "
                f"{(r.get('measured_peak_reserved_bytes') or float('nan')) / GIB:.2f} GiB, "
                f"{r['predicted_it_per_s']:.3g} / {r.get('measured_it_per_s') or float('nan'):.3g} it/s")
            print(f"{r['family']:17} {r['tier_gb']:>4g} {said}")
            continue
        s = r["settings"]
        meas = r.get("measured_peak_reserved_bytes")
        print(f"{r['family']:17} {r['tier_gb']:>4g} {s['train_batch_size']:>3} {s['gradient_accumulation_steps']:>3} "
              f"{'on' if s['gradient_checkpointing'] else 'off':>3} {s['resolution'].split(',')[0]:>5} "
              f"{s['network_dim']:>4} {s['optimizer_type']:>10} "
              f"{r['predicted_peak_without_context_bytes'] / GIB:>8.2f} "
              f"{(meas / GIB if meas else float('nan')):>8.2f} "
              f"{r.get('peak_ratio_measured_over_predicted', float('nan')):>6.2f} "
              f"{r['predicted_it_per_s']:>9.3g} {(r.get('measured_it_per_s') or float('nan')):>9.3g} "
              f"{r.get('speed_ratio_measured_over_predicted', float('nan')):>6.2f} {'OOM' if r['oom'] else '-'}")


def budgeted_rows(case: str, families: list[str], tier_gb: float, spent: bool, path: Path,
                  measure: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One check's rows, written to ``path``; each family listed as skipped once the time budget is spent."""
    if spent:
        return [{"family": f, "tier_gb": tier_gb, "case": case, "would_measure": "skipped: time budget spent"}
                for f in families]
    rows = measure()
    write_json(path, rows)
    return rows


def unet_rows(torch: Any, spec: Any, families: list[str], tiers: list[float], args: argparse.Namespace, out: Path, *,
              device: str, steps: int, warmup: int, over_budget: Callable[[], bool]) -> list[dict[str, Any]]:
    """Each UNet family planned for each tier and trained at its plan (tiny twins in a dry run); a row each."""
    dry = args.dry_run
    rows: list[dict[str, Any]] = []
    for family in families:
        for tier in tiers:
            name = f"{family}_{tier:g}gb"
            if over_budget():
                rows.append({"family": family, "tier_gb": tier, "skipped": "time budget spent"})
                continue
            plan = make_plan(family, tier, spec, args.goal)
            if not plan.fits:
                row = {"family": family, "tier_gb": tier, "skipped": plan.message, "oom": False}
                rows.append(row)
                write_json(out / f"{name}.json", row)
                continue
            case_start = time.perf_counter()
            try:
                measured = run_case(torch, plan, f"tiny-{family}" if dry else family, device, tier, steps, warmup,
                                    resolution=64 if dry else None)
            except Exception as error:  # noqa: BLE001 - one broken case (a missing kernel) must not end the lease
                measured = failed_case(torch, error)
            row = summarize(plan, measured, family, tier)
            row["seconds"] = round(time.perf_counter() - case_start, 2)
            rows.append(row)
            write_json(out / f"{name}.json", row)
            print(f"{name}: {row['seconds']} s, oom={row['oom']}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = result_dir(args.out)
    import torch

    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("no CUDA GPU: run on a CUDA machine, or pass --dry-run to test the script on tiny models",
              file=sys.stderr)
        return 2
    device = "cpu" if dry else "cuda"
    if dry:
        torch.set_num_threads(1)  # tiny tensors: more threads only contend with each other
    steps = args.steps if args.steps is not None else (2 if dry else 8)
    warmup = args.warmup if args.warmup is not None else (1 if dry else 3)
    spec = device_spec(torch, dry)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    tiers = [float(t) for t in args.tiers.split(",") if t.strip()]
    began = time.perf_counter()
    rows: list[dict[str, Any]] = []
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if not dry else "cpu (dry run)",
           "catalogue_card": spec.name, "dry_run": dry, "steps": steps, "warmup": warmup}
    rows += unet_rows(torch, spec, families, tiers, args, out, device=device, steps=steps, warmup=warmup,
                      over_budget=lambda: time.perf_counter() - began > args.budget)
    dit_families = [f.strip() for f in args.dit_families.split(",") if f.strip()]
    dit_tiers = [float(t) for t in args.dit_tiers.split(",") if t.strip()]
    if dit_families and dit_tiers:  # the planned swap counts; a dry run plans them and steps the tiny twins
        from bench.gpu_validate_dit import dit_rows

        rows += dit_rows(torch, spec, dit_families, dit_tiers, args.goal, steps, warmup, dry, write_json, out,
                         budget_left=lambda: args.budget - (time.perf_counter() - began))

    def spent() -> bool:
        return time.perf_counter() - began > args.budget

    layout_families = [f.strip() for f in args.layout_check.split(",") if f.strip()]
    if layout_families:  # before the compile check, which may take the rest of the budget
        from bench.gpu_layout_check import layout_rows

        rows += budgeted_rows("layout", layout_families, args.compile_tier, spent(), out / "layout_check.json",
                              lambda: layout_rows(torch, spec, layout_families, args.compile_tier, args.goal, steps,
                                                  warmup, dry))
    compile_families = [f.strip() for f in args.compile_check.split(",") if f.strip()]
    if compile_families:  # last and within the budget: an inductor compile of SDXL's blocks can take minutes
        from bench.gpu_compile_check import compile_rows

        rows += budgeted_rows("compile", compile_families, args.compile_tier, spent(), out / "compile_check.json",
                              lambda: compile_rows(torch, spec, compile_families, args.compile_tier, args.goal, steps,
                                                   warmup, dry))
    summary = {"environment": env, "seconds": round(time.perf_counter() - began, 1), "cases": rows}
    write_json(out / "summary.json", summary)
    print_table([r for r in rows if r.get("case") not in ("compile", "layout")])
    if layout_families:
        from bench.gpu_layout_check import print_layout_table

        print_layout_table([r for r in rows if r.get("case") == "layout"])
    if compile_families:
        from bench.gpu_compile_check import print_compile_table

        print_compile_table([r for r in rows if r.get("case") == "compile"])
    print(f"wrote {out / 'summary.json'} ({summary['seconds']} s)")
    if not dry and torch.cuda.device_count() >= 2:  # a machine with several GPUs: the link and sharding (issue 53)
        from bench.gpu_sharding_check import main as sharding_check

        sharding_check([str(out / "sharding")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
