"""kohya-compatible LoRA training: ``python -m sd_scripts_compat.train_network --config_file config.toml``.

The same flags as sd-scripts' ``train_network.py`` (and ``sdxl_train_network.py``, which calls
``main(sdxl=True)``). The whole run reads top to bottom in ``train``: load, cache, build the LoRA,
then the loop. The hot path does no per-step host syncs (the running loss stays on the device and is
read only when the progress bar refreshes), feeds cached latents when asked, and copies batches with
pinned memory and ``non_blocking``.

Extension flags (ours, command line only): ``--autotune_events_dir``, ``--save_state_every_seconds``,
``--autotune_retry_log``; see ``sd_scripts_compat.contract`` for the watchdog contract.
"""

from __future__ import annotations

import gc
import json
import math
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sd_scripts_compat.contract import DONE, INTERRUPTED_EXIT_CODE, OOM, OOM_EXIT_CODE, PROGRESS, is_oom_error
from sd_scripts_compat.errors import UserError

PROGRESS_EVERY_SECONDS = 2.0
TIMING_WARMUP_STEPS = 2


def main(argv: list[str] | None = None, *, sdxl: bool = False) -> int:
    from sd_scripts_compat.config.training_config import load_training_config

    program = "sdxl_train_network" if sdxl else "train_network"
    try:
        config = load_training_config(sys.argv[1:] if argv is None else argv, sdxl=sdxl)
        return train(config, sdxl=sdxl)
    except UserError as error:
        print(f"{program}: error: {error}", file=sys.stderr)
        return error.exit_code


@dataclass
class RunPaths:
    output_dir: Path
    output_name: str
    events_dir: Path | None

    def lora_file(self, suffix: str = "") -> Path:
        return self.output_dir / f"{self.output_name}{suffix}.safetensors"

    def state_dir(self) -> Path:
        """The rolling state folder (kohya's ``{output_name}-state``); per-step ones come from save_every_n_*."""
        return self.output_dir / f"{self.output_name}-state"


class DynamicLossScale:
    """Loss scaling for ``full_fp16``, where LoRA weights and gradients are fp16.

    Hand-written because torch's GradScaler refuses to unscale fp16 gradients by design.
    """

    def __init__(self, scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.scale, self.growth_interval, self.good_steps = scale, growth_interval, 0

    def unscale_and_check(self, params: list[Any]) -> bool:
        import torch

        grads = [p.grad for p in params if p.grad is not None]
        for grad in grads:
            grad.div_(self.scale)
        finite = bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()) if grads else True
        if finite:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= 2.0
        else:
            self.scale, self.good_steps = max(self.scale / 2.0, 1.0), 0
        return finite


def train(config: Any, *, sdxl: bool) -> int:  # noqa: C901 - one recipe, top to bottom, on purpose
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from diffusers import DDPMScheduler

    from sd_scripts_compat.caching.latent_cache import cache_latents, encode_images, offload
    from sd_scripts_compat.caching.text_cache import cache_text_encoder_outputs
    from sd_scripts_compat.config.settings import dataset_report, resolved_settings
    from sd_scripts_compat.config.training_config import dataset_group_from_config
    from sd_scripts_compat.contract import memory_figures, write_event
    from sd_scripts_compat.dataset.train_dataset import (
        BucketBatchSampler,
        build_dataset,
        build_validation_dataset,
        make_dataloader,
    )
    from sd_scripts_compat.models.loading import load_base_model
    from sd_scripts_compat.network.lora import create_network, create_network_from_weights, parse_network_args
    from sd_scripts_compat.network.lora_file import TrainingFacts, build_metadata, read_lora_file, save_lora_file
    from sd_scripts_compat.training.faults import OomInjector
    from sd_scripts_compat.training.objectives import (
        NoiseSettings,
        diffusion_target,
        per_sample_loss,
        sample_noise_and_timesteps,
        step_generator,
    )
    from sd_scripts_compat.training.optim import make_lr_scheduler, make_optimizer
    from sd_scripts_compat.training.precision import fp8_supported, store_frozen_weights_in_fp8
    from sd_scripts_compat.training.train_state import (
        TrainCounters,
        load_train_state,
        restore_rng_state,
        save_train_state,
    )

    started = time.time()
    # ---- 1. Process, precision, output folder --------------------------------------------------
    paths = RunPaths(Path(config.output_dir or "output"), _safe_output_name(config.output_name or "last"),
                     Path(config.autotune_events_dir) if config.autotune_events_dir else None)
    _check_output_dir(paths.output_dir)
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),  # several CPU processes (accelerate launch / torchrun) then use gloo
        mixed_precision=config.mixed_precision,
        log_with=config.log_with if config.logging_dir else None,
        project_dir=config.logging_dir,
    )
    device = accelerator.device
    seed = config.seed if config.seed is not None else 42
    set_seed(seed)
    weight_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(accelerator.mixed_precision, torch.float32)
    if device.type == "cpu" and weight_dtype == torch.float16:
        weight_dtype = torch.float32  # accelerate keeps fp16 "mixed precision" on CPU as fp32
    save_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "float": torch.float32}.get(
        config.save_precision or "float", torch.float32)
    injector = OomInjector.from_env(paths.events_dir or paths.output_dir)

    # ---- 2. Base model ------------------------------------------------------------------------
    bundle = load_base_model(config.pretrained_model_name_or_path, allow_pickle=config.allow_pickle,
                             family=_stated_family(config, sdxl))
    family = bundle.family
    vae_scale = 2 ** (len(bundle.vae.config.block_out_channels) - 1)  # pixels per latent pixel
    if family.is_sdxl != sdxl:
        entry = "sdxl_train_network" if family.is_sdxl else "train_network"
        raise UserError(f"{config.pretrained_model_name_or_path}: this is a {family.description} model; "
                        f"train it with sd_scripts_compat.{entry}")
    v_parameterization = bool(config.v_parameterization) or family.v_parameterization
    if config.xformers:
        _enable_xformers(bundle.unet)
    elif config.sdpa is not False:
        from diffusers.models.attention_processor import AttnProcessor2_0

        bundle.unet.set_attn_processor(AttnProcessor2_0())

    # ---- 3. Datasets ---------------------------------------------------------------------------
    group = dataset_group_from_config(config, default_resolution=(family.resolution, family.resolution))
    if len(group.datasets) != 1:
        raise UserError(f"dataset_config: {len(group.datasets)} [[datasets]] given; this engine trains on exactly "
                        "one (put several folders as [[datasets.subsets]] of one dataset)")
    dataset_spec = group.datasets[0]
    train_data = build_dataset(dataset_spec, seed=seed, prior_loss_weight=config.prior_loss_weight)
    validation_data = build_validation_dataset(dataset_spec, seed=seed, prior_loss_weight=config.prior_loss_weight) \
        if dataset_spec.validation_split > 0 else None
    datasets = [d for d in (train_data, validation_data) if d is not None]

    # ---- 4. Caching: latents, then text-encoder outputs; encoders no longer needed leave the device
    vae_dtype = torch.float32 if config.no_half_vae or device.type == "cpu" else weight_dtype
    _place(bundle.vae, device, vae_dtype)
    cached_latents = bool(config.cache_latents or config.cache_latents_to_disk)
    if cached_latents:
        for dataset in datasets:
            cache_latents(dataset, bundle.vae, device=device, dtype=vae_dtype, vae_batch_size=config.vae_batch_size,
                          to_disk=bool(config.cache_latents_to_disk), is_main_process=accelerator.is_main_process)
        accelerator.wait_for_everyone()  # other processes read the files the main process wrote
        offload(bundle.vae)
    train_text_encoder = not config.network_train_unet_only and _text_encoder_lr(config) != 0
    for encoder in bundle.text_encoders:
        _place(encoder, device, weight_dtype)
    cached_text = bool(config.cache_text_encoder_outputs or config.cache_text_encoder_outputs_to_disk)
    if not cached_text and not train_text_encoder and _captions_fixed(datasets):
        # A frozen text encoder gives a fixed caption the same output at every step: encode each caption
        # once, in memory (sd-scripts re-encodes every step for SD 1.x/2.x; the outputs are the same).
        cached_text = True
        accelerator.print("text encoders are not trained and captions are fixed: their outputs are cached in memory")
    if cached_text:
        for dataset in datasets:
            cache_text_encoder_outputs(dataset, bundle, device=device, dtype=weight_dtype,
                                       to_disk=bool(config.cache_text_encoder_outputs_to_disk),
                                       max_token_length=config.max_token_length, clip_skip=config.clip_skip,
                                       is_main_process=accelerator.is_main_process)
        accelerator.wait_for_everyone()
        for encoder in bundle.text_encoders:
            offload(encoder)
    conditioner = _Conditioner(bundle, max_token_length=config.max_token_length, clip_skip=config.clip_skip,
                               dtype=weight_dtype)

    # ---- 5. UNet precision, LoRA network, optimizer, schedule -------------------------------------
    unet = bundle.unet
    use_fp8 = bool(config.fp8_base or config.fp8_base_unet)
    if use_fp8 and not fp8_supported(device):
        raise UserError("fp8_base needs a GPU with compute capability 8.9 or newer (Ada, Hopper); remove fp8_base")
    _place(unet, device, weight_dtype)
    if use_fp8:
        store_frozen_weights_in_fp8(unet, weight_dtype)
    if config.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
        if train_text_encoder:
            for encoder in bundle.text_encoders:
                enable = getattr(encoder, "activation_checkpointing_enable", None) or \
                    encoder.gradient_checkpointing_enable  # renamed in transformers 5
                enable()
    network_kwargs = parse_network_args(config.network_args)
    if config.network_weights and config.dim_from_weights:
        network = create_network_from_weights(bundle, config.network_weights, train_unet=True,
                                              train_text_encoder=train_text_encoder)
    else:
        network = create_network(bundle, network_dim=config.network_dim or 4,
                                 network_alpha=config.network_alpha if config.network_alpha is not None else 1.0,
                                 dropout=config.network_dropout, train_unet=True,
                                 train_text_encoder=train_text_encoder, **network_kwargs)
        if config.network_weights:
            network.load_kohya_state_dict(read_lora_file(config.network_weights)[0])
    network.apply_to()
    lora_dtype = {(True, False): torch.float16, (False, True): torch.bfloat16}.get(
        (bool(config.full_fp16), bool(config.full_bf16)), torch.float32)
    network.to(device, dtype=lora_dtype)
    network.train()
    trainable = [p for p in network.parameters() if p.requires_grad]
    param_groups = network.prepare_optimizer_params(_text_encoder_lr(config), config.unet_lr, config.learning_rate)
    optimizer, optimizer_description = make_optimizer(config.optimizer_type or "AdamW", param_groups,
                                                      config.learning_rate, config.optimizer_args)

    world, rank = accelerator.num_processes, accelerator.process_index
    accumulation = max(1, config.gradient_accumulation_steps)
    batches_per_epoch = train_data.num_batches(world)
    steps_per_epoch = max(1, math.ceil(batches_per_epoch / accumulation))
    if config.max_train_epochs:
        max_train_steps = steps_per_epoch * config.max_train_epochs
    else:
        max_train_steps = config.max_train_steps
    total_epochs = math.ceil(max_train_steps / steps_per_epoch)
    train_data.max_train_steps = max_train_steps
    warmup_steps = config.warmup_steps(max_train_steps)
    lr_scheduler = make_lr_scheduler(config.lr_scheduler, optimizer, num_training_steps=max_train_steps,
                                     num_warmup_steps=warmup_steps, num_cycles=config.lr_scheduler_num_cycles or 1,
                                     power=config.lr_scheduler_power or 1.0, learning_rate=config.learning_rate,
                                     scheduler_args=config.lr_scheduler_args)
    loss_scale = DynamicLossScale() if config.full_fp16 else None
    if loss_scale is None:
        optimizer = accelerator.prepare(optimizer)  # GradScaler for fp16 mixed precision lives here

    noise_scheduler = DDPMScheduler.from_config(bundle.scheduler_config)
    alphas_cumprod = noise_scheduler.alphas_cumprod.to(device)
    noise = NoiseSettings(noise_offset=config.noise_offset, min_timestep=config.min_timestep or 0,
                          max_timestep=config.max_timestep or 1000, v_parameterization=v_parameterization,
                          min_snr_gamma=config.min_snr_gamma)

    # ---- 6. Resume -----------------------------------------------------------------------------
    counters = TrainCounters()
    if config.resume:
        state = load_train_state(Path(config.resume))
        network.load_kohya_state_dict(state.lora_state)
        _unwrap(optimizer).load_state_dict(state.optimizer_state)
        lr_scheduler.load_state_dict(state.lr_scheduler_state)
        restore_rng_state(state.rng)
        counters = state.counters
        saved_batch = int(counters.extra.get("micro_batch", dataset_spec.batch_size))
        if saved_batch != dataset_spec.batch_size:
            # the watchdog changed the micro-batch: skip the samples already seen (rounded down, so none is
            # skipped unseen; at most one micro-batch of samples is seen twice)
            counters.step_in_epoch = counters.step_in_epoch * saved_batch // dataset_spec.batch_size
        accelerator.print(f"resumed from {config.resume} at step {counters.global_step} (epoch {counters.epoch + 1})")

    settings = resolved_settings(config, dataset_spec).to_event()  # what ran: the ladder steps down from it
    resolved = {"datasets": [dataset_report(dataset_spec)], "latents_cached": cached_latents,
                "text_encoder_outputs_cached": cached_text, "weight_dtype": str(weight_dtype).replace("torch.", "")}
    session_id = secrets.randbits(31)  # ss_session_id, as sd-scripts writes it
    retries = _read_retry_log(config.autotune_retry_log)
    tracker_config = {"max_train_steps": max_train_steps, "train_batch_size": dataset_spec.batch_size}
    if config.logging_dir and config.log_with:
        accelerator.init_trackers(config.log_prefix or "network_train", config=tracker_config)

    def save_state(folder: Path) -> Path:
        counters.extra["micro_batch"] = dataset_spec.batch_size
        return save_train_state(folder, lora_state=network.kohya_state_dict(), optimizer=_unwrap(optimizer),
                                lr_scheduler=lr_scheduler, counters=counters, settings=settings)

    def save_lora(path: Path, *, epoch: int, final: bool) -> None:
        facts = TrainingFacts(
            output_name=path.stem, network_dim=config.network_dim, network_alpha=config.network_alpha,
            learning_rate=config.learning_rate, optimizer=optimizer_description,
            resolution=dataset_spec.resolution, training_started_at=started, session_id=session_id,
            network_args=dict(config.network_args) or None, network_dropout=config.network_dropout,
            unet_lr=config.unet_lr, text_encoder_lr=_text_encoder_lr(config), lr_scheduler=config.lr_scheduler,
            lr_warmup_steps=warmup_steps, mixed_precision=accelerator.mixed_precision,
            num_train_images=train_data.num_train_images, num_reg_images=train_data.num_reg_images,
            num_batches_per_epoch=batches_per_epoch, num_epochs=total_epochs, epoch=epoch,
            steps=counters.global_step, max_train_steps=max_train_steps,
            batch_size_per_device=dataset_spec.batch_size,
            total_batch_size=dataset_spec.batch_size * world * accumulation,
            gradient_checkpointing=bool(config.gradient_checkpointing), gradient_accumulation_steps=accumulation,
            max_grad_norm=config.max_grad_norm, seed=seed, clip_skip=config.clip_skip,
            max_token_length=config.max_token_length, cache_latents=cached_latents,
            noise_offset=config.noise_offset, min_snr_gamma=config.min_snr_gamma,
            training_finished_at=time.time() if final else None,
            sd_model_name=Path(config.pretrained_model_name_or_path or "").name,
            tag_frequency=train_data.tag_frequencies, dataset_dirs=train_data.dataset_dirs(),
            training_comment=config.training_comment,
            extra={"ss_autotune_retries": json.dumps(retries)} if retries else {},
        )
        save_lora_file(path, network.kohya_state_dict(), build_metadata(family, facts), save_dtype=save_dtype)

    # ---- 7. The loop ---------------------------------------------------------------------------
    from tqdm.auto import tqdm

    progress = tqdm(total=max_train_steps, initial=counters.global_step, disable=not accelerator.is_main_process,
                    desc="steps", dynamic_ncols=True, smoothing=0.1)
    running_loss = torch.zeros((), device=device)
    running_count = 0
    last_report = last_state_save = time.time()
    peak_memory_mib = 0.0
    loader_workers = config.max_data_loader_n_workers if config.max_data_loader_n_workers is not None else 0
    validation = _ValidationRun(validation_data, config, seed) if validation_data is not None else None
    oom: dict[str, Any] | None = None
    interrupted = False
    step_started = time.time()
    step_ended_at: list[float] = []  # host clock at each optimizer step of this session (for done.json)
    if validation is not None and counters.global_step == 0:  # the baseline the curve is read against
        validation.run(unet, conditioner, noise_scheduler, weight_dtype, accelerator, 0, train_text_encoder, noise,
                       alphas_cumprod)
    sampler = BucketBatchSampler(train_data, epoch=counters.epoch, start_step=counters.step_in_epoch,
                                 num_replicas=world, rank=rank)
    loader = make_dataloader(train_data, sampler, num_workers=loader_workers,
                             persistent_workers=bool(config.persistent_data_loader_workers),
                             pin_memory=device.type == "cuda")
    try:
        while counters.global_step < max_train_steps:
            epoch = counters.epoch
            sampler.set_epoch(epoch, start_step=counters.step_in_epoch)
            batch_index = counters.step_in_epoch  # micro-batches of this epoch consumed by this process
            for batch in loader:
                batch = _to_device(batch, device)
                latents = batch.get("latents")
                if latents is None:
                    with torch.no_grad():
                        seeds = [(seed * 1_000_003 + counters.global_step * 4099 + batch_index * 131 + i) % 2**63
                                 for i in range(batch["images"].shape[0])]
                        latents = encode_images(bundle.vae, batch["images"], noise_seeds=seeds,
                                                scaling_factor=bundle.vae.config.scaling_factor)
                latents = latents.to(weight_dtype)
                if injector is not None:
                    injector.check(counters.global_step, latents.shape[0], latents.shape[2] * vae_scale,
                                   latents.shape[3] * vae_scale)
                generator = step_generator(seed, counters.global_step, batch_index * world + rank, device)
                with accelerator.autocast():
                    encoder_hidden, added_cond = conditioner.condition(batch, train=train_text_encoder)
                    step_noise, timesteps = sample_noise_and_timesteps(latents, noise, generator)
                    noisy = noise_scheduler.add_noise(latents, step_noise, timesteps)
                    prediction = unet(noisy, timesteps, encoder_hidden, added_cond_kwargs=added_cond).sample
                target = diffusion_target(noise_scheduler, latents, step_noise, timesteps, v_parameterization)
                loss = per_sample_loss(prediction, target, timesteps, batch["loss_weights"], alphas_cumprod,
                                       noise).mean()
                scaled = loss / accumulation
                if loss_scale is not None:
                    (scaled * loss_scale.scale).backward()
                else:
                    accelerator.backward(scaled)
                running_loss += loss.detach()
                running_count += 1
                batch_index += 1
                if batch_index % accumulation != 0 and batch_index < batches_per_epoch:
                    continue
                # -- optimizer step (one per `accumulation` micro-batches) --
                if world > 1:
                    _average_gradients(trainable, world)
                do_step = loss_scale.unscale_and_check(trainable) if loss_scale is not None else True
                if config.max_grad_norm and do_step:
                    if loss_scale is None:
                        accelerator.clip_grad_norm_(trainable, config.max_grad_norm)
                    else:
                        torch.nn.utils.clip_grad_norm_(trainable, config.max_grad_norm)
                if do_step:
                    optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                counters.global_step += 1
                counters.step_in_epoch = batch_index  # only whole optimizer steps count as consumed
                now = time.time()
                step_ended_at.append(now)
                progress.update(1)

                if now - last_report >= PROGRESS_EVERY_SECONDS or counters.global_step == max_train_steps:
                    mean_loss = (running_loss / max(running_count, 1)).item()  # the one host sync, ~every 2 s
                    running_loss.zero_()
                    running_count = 0
                    rate = len(step_ended_at) / max(now - step_started, 1e-9)
                    peak_memory_mib = max(peak_memory_mib, _peak_memory_mib(device))
                    progress.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{lr_scheduler.get_last_lr()[0]:.2e}")
                    accelerator.log({"loss/current": mean_loss, "lr/unet": lr_scheduler.get_last_lr()[-1],
                                     "speed/it_per_s": rate, "memory/peak_mib": peak_memory_mib},
                                    step=counters.global_step)
                    if paths.events_dir and accelerator.is_main_process:
                        write_event(paths.events_dir, PROGRESS, {
                            "step": counters.global_step, "epoch": counters.epoch, "max_train_steps": max_train_steps,
                            "time": now, "it_per_s": rate, "loss": mean_loss})
                    last_report = now
                if validation is not None and validation.due(counters.global_step, epoch_end=False):
                    validation.run(unet, conditioner, noise_scheduler, weight_dtype, accelerator, counters.global_step,
                                   train_text_encoder, noise, alphas_cumprod)
                if config.save_every_n_steps and counters.global_step % config.save_every_n_steps == 0:
                    _save_checkpoint(accelerator, paths, config, counters, save_lora, save_state,
                                     suffix=f"-step{counters.global_step:08d}", step=counters.global_step)
                if (config.save_state_every_seconds and accelerator.is_main_process
                        and now - last_state_save >= config.save_state_every_seconds):
                    save_state(paths.state_dir())
                    last_state_save = now
                if config.sample_every_n_steps and counters.global_step % config.sample_every_n_steps == 0:
                    _sample(bundle, config, paths, accelerator, weight_dtype, dataset_spec.resolution,
                            f"step{counters.global_step:08d}")
                if counters.global_step >= max_train_steps:
                    break
            else:  # the epoch ran to its end
                counters.epoch += 1
                counters.step_in_epoch = 0
                if validation is not None and validation.due(counters.global_step, epoch_end=True,
                                                              epoch=counters.epoch):
                    validation.run(unet, conditioner, noise_scheduler, weight_dtype, accelerator,
                                   counters.global_step, train_text_encoder, noise, alphas_cumprod)
                if config.save_every_n_epochs and counters.epoch % config.save_every_n_epochs == 0 \
                        and counters.global_step < max_train_steps:
                    _save_checkpoint(accelerator, paths, config, counters, save_lora, save_state,
                                     suffix=f"-{counters.epoch:06d}", step=None)
                if config.sample_every_n_epochs and counters.epoch % config.sample_every_n_epochs == 0:
                    _sample(bundle, config, paths, accelerator, weight_dtype, dataset_spec.resolution,
                            f"e{counters.epoch:06d}")
                continue
            break
    except KeyboardInterrupt:
        interrupted = True
    except Exception as error:  # noqa: BLE001 - only OOMs are handled; everything else re-raises
        if not is_oom_error(error):
            raise
        oom = {"message": str(error).splitlines()[0][:500], "type": type(error).__name__}
    # Outside the except block: the exception's frames (and the activations they hold) are gone now.
    progress.close()

    if oom is not None:
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        _free_device_memory(device)
        state_dir = None
        if accelerator.is_main_process and counters.global_step > 0:
            state_dir = str(save_state(paths.state_dir()))
        event = {"step": counters.global_step, "epoch": counters.epoch, "settings": settings, "resolved": resolved,
                 "memory": memory_figures(), "message": oom["message"], "state_dir": state_dir}
        if paths.events_dir and accelerator.is_main_process:
            write_event(paths.events_dir, OOM, event)
        print(f"out of memory at step {counters.global_step}: {oom['message']}", file=sys.stderr)
        return OOM_EXIT_CODE
    if interrupted:
        if accelerator.is_main_process:
            folder = save_state(paths.state_dir())
            print(f"\ninterrupted at step {counters.global_step}; state saved to {folder} "
                  f"(continue with --resume {folder})", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE

    # ---- 8. Final LoRA and summary ---------------------------------------------------------------
    accelerator.wait_for_everyone()
    output_file = paths.lora_file()
    if accelerator.is_main_process:
        save_lora(output_file, epoch=counters.epoch, final=True)
        if config.save_state or config.save_state_on_train_end:
            save_state(paths.state_dir())
    peak_memory_mib = max(peak_memory_mib, _peak_memory_mib(device))
    seconds = time.time() - started
    # steady state: after the first steps (allocator, caches); one duration per optimizer step
    step_seconds = [b - a for a, b in zip(step_ended_at[TIMING_WARMUP_STEPS - 1:], step_ended_at[TIMING_WARMUP_STEPS:])]
    seconds_per_step = sum(step_seconds) / len(step_seconds) if step_seconds else None
    if accelerator.is_main_process:
        if paths.events_dir:
            write_event(paths.events_dir, DONE, {
                "output_file": str(output_file), "steps": counters.global_step, "seconds": seconds,
                "seconds_per_step": seconds_per_step, "step_seconds": step_seconds, "peak_memory": peak_memory_mib,
                "validation_loss": validation.history if validation is not None else [],
                "settings": settings, "resolved": resolved})
        print(f"done: {counters.global_step} steps in {seconds:.1f} s, peak memory {peak_memory_mib:.0f} MiB, "
              f"LoRA written to {output_file}")
    accelerator.end_training()
    return 0


# ---- helpers: small, explicit, no state of their own ---------------------------------------------

class _Conditioner:
    """UNet conditioning for a batch: cached text-encoder outputs when the batch carries them, else a
    live encode (with gradients only when the text-encoder LoRA trains); SDXL adds size conditioning."""

    def __init__(self, bundle: Any, *, max_token_length: int | None, clip_skip: int | None, dtype: Any) -> None:
        self.bundle, self.max_token_length, self.clip_skip, self.dtype = bundle, max_token_length, clip_skip, dtype

    def condition(self, batch: dict[str, Any], *, train: bool) -> tuple[Any, dict[str, Any] | None]:
        import torch

        from sd_scripts_compat.models.text_encoding import encode_prompts, sdxl_time_ids

        if "encoder_hidden_states" in batch:
            hidden, pooled = batch["encoder_hidden_states"].to(self.dtype), batch.get("pooled")
        else:
            with torch.set_grad_enabled(train):
                encoded = encode_prompts(self.bundle, batch["captions"], max_token_length=self.max_token_length,
                                         clip_skip=self.clip_skip, dtype=self.dtype)
            hidden, pooled = encoded.encoder_hidden_states, encoded.pooled
        if not self.bundle.family.is_sdxl:
            return hidden, None
        time_ids = sdxl_time_ids(batch["original_sizes_hw"], batch["crop_top_lefts"], batch["target_sizes_hw"],
                                 dtype=self.dtype).to(hidden.device)
        return hidden, {"text_embeds": pooled.to(hidden.device, self.dtype), "time_ids": time_ids}


def _captions_fixed(datasets: list[Any]) -> bool:
    """True when no caption option (shuffle, dropout, warm-up) changes a processed caption between steps."""
    from sd_scripts_compat.dataset.captions import caption_is_deterministic

    return all(caption_is_deterministic(subset) is None for dataset in datasets for subset in dataset.subsets)


def _text_encoder_lr(config: Any) -> float | None:
    """kohya allows one text_encoder_lr per encoder; the network takes one for all of them."""
    lrs = config.text_encoder_lr
    if not lrs:
        return None
    if len(set(lrs)) > 1:
        raise UserError(f"text_encoder_lr = {list(lrs)}: one learning rate per text encoder is not supported; "
                        "give a single value")
    return lrs[0]


def _safe_output_name(name: str) -> str:
    """Every file we write is ``output_dir / (output_name + suffix)``: the name must not lead elsewhere."""
    if not name or name in (".", "..") or Path(name).name != name or "\\" in name or "\0" in name:
        raise UserError(f"output_name = {name!r}: must be a plain file name (no folders); "
                        "put the folder in output_dir")
    return name


def _check_output_dir(output_dir: Path) -> None:
    import os

    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"{output_dir}: cannot create the output folder ({error.strerror}); "
                        "choose another output_dir") from None
    if not os.access(output_dir, os.W_OK):
        raise UserError(f"{output_dir}: output folder is not writable; choose another output_dir")


def _stated_family(config: Any, sdxl: bool) -> str | None:
    """The family the user's flags state (kohya has no family flag: sdxl entry point, v2, v_parameterization)."""
    if sdxl:
        return None  # detected from the file; train() checks it is SDXL
    if config.v2:
        return "sd2-v" if config.v_parameterization else "sd2"
    return None


def _enable_xformers(unet: Any) -> None:
    try:
        import xformers  # noqa: F401
    except ImportError:
        raise UserError("xformers = true but xformers is not installed; pip install 'lora-autotune[xformers]' "
                        "or remove xformers (torch SDPA is the default)") from None
    try:
        unet.enable_xformers_memory_efficient_attention()
    except (ValueError, NotImplementedError, RuntimeError) as error:
        raise UserError(f"xformers is installed but cannot run here ({str(error).splitlines()[0]}); "
                        "remove xformers to use torch SDPA") from None


def _place(module: Any, device: Any, dtype: Any) -> None:
    """Move a module; cast only when its dtype differs (diffusers warns on every dtype cast)."""
    if next(module.parameters()).dtype == dtype:
        module.to(device)
    else:
        module.to(device, dtype=dtype)


def _free_device_memory(device: Any) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _peak_memory_mib(device: Any) -> float:
    import resource

    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _unwrap(optimizer: Any) -> Any:
    return getattr(optimizer, "optimizer", optimizer)


def _to_device(batch: dict[str, Any], device: Any) -> dict[str, Any]:
    import torch

    non_blocking = device.type == "cuda"
    return {k: v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()}


def _average_gradients(params: list[Any], world: int) -> None:
    """Average LoRA gradients across processes with one all-reduce.

    The LoRA hooks into the UNet's layers, so its own forward is never called through a DDP wrapper;
    one flat all-reduce per optimizer step is what DDP would do for these few parameters.
    """
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.div_(world)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def _read_retry_log(path: str | None) -> list[Any]:
    if not path:
        return []
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise UserError(f"{path}: cannot read the retry log ({error})") from None


def _save_checkpoint(accelerator: Any, paths: RunPaths, config: Any, counters: Any, save_lora: Any,
                     save_state: Any, *, suffix: str, step: int | None) -> None:
    """An intermediate LoRA (+ state with --save_state), pruning old ones per save_last_n_*."""
    import shutil

    if not accelerator.is_main_process:
        return
    save_lora(paths.lora_file(suffix), epoch=counters.epoch, final=False)
    if config.save_state:
        save_state(paths.output_dir / f"{paths.output_name}{suffix}-state")
    keep = config.save_last_n_steps if step is not None else config.save_last_n_epochs
    if not keep:
        return
    pattern = f"{paths.output_name}-step*" if step is not None else f"{paths.output_name}-[0-9]*"
    lora_files = sorted(p for p in paths.output_dir.glob(pattern + ".safetensors"))
    for old in lora_files[:-keep] if step is None else lora_files:
        if step is not None:
            old_step = int(old.stem.rsplit("-step", 1)[1])
            if old_step > step - keep:  # kohya: keep those within the last `keep` steps
                continue
        old.unlink(missing_ok=True)
        shutil.rmtree(old.with_name(old.stem + "-state"), ignore_errors=True)


def _sample(bundle: Any, config: Any, paths: RunPaths, accelerator: Any, dtype: Any, resolution: tuple[int, int],
            name: str) -> None:
    from sd_scripts_compat.training.sampling import read_sample_prompts, render_samples

    if not config.sample_prompts or not accelerator.is_main_process:
        return
    prompts = read_sample_prompts(config.sample_prompts, resolution)
    training = [m.training for m in (bundle.unet, *bundle.text_encoders)]
    vae_device = next(bundle.vae.parameters()).device
    bundle.vae.to(accelerator.device)
    text_devices = [next(te.parameters()).device for te in bundle.text_encoders]
    for encoder in bundle.text_encoders:
        encoder.to(accelerator.device)
    try:
        render_samples(bundle, prompts, sampler=config.sample_sampler or "ddim", out_dir=paths.output_dir / "sample",
                       name=f"{paths.output_name}_{name}", device=accelerator.device, dtype=dtype,
                       clip_skip=config.clip_skip)
    finally:
        bundle.vae.to(vae_device)
        for encoder, device, was_training in zip(bundle.text_encoders, text_devices, training[1:]):
            encoder.to(device)
            encoder.train(was_training)
        bundle.unet.train(training[0])


class _ValidationRun:
    """Held-out loss at fixed timesteps and noise, so over-training shows as a rising curve."""

    def __init__(self, dataset: Any, config: Any, seed: int) -> None:
        self.dataset = dataset
        self.every_steps = config.validate_every_n_steps
        self.every_epochs = config.validate_every_n_epochs
        self.seed = config.validation_seed if config.validation_seed is not None else seed
        self.history: list[tuple[int, float]] = []

    def due(self, step: int, *, epoch_end: bool, epoch: int = 0) -> bool:
        if epoch_end:
            return bool(self.every_epochs and epoch % self.every_epochs == 0) or (
                not self.every_steps and not self.every_epochs)
        return bool(self.every_steps and step % self.every_steps == 0)

    def run(self, unet: Any, conditioner: Any, noise_scheduler: Any, dtype: Any, accelerator: Any, step: int,
            train_text_encoder: bool, noise_settings: Any, alphas_cumprod: Any) -> float:
        loss = validation_loss(self.dataset, unet, conditioner, noise_scheduler, dtype, accelerator.device,
                               self.seed, noise_settings, alphas_cumprod)
        self.history.append((step, loss))
        accelerator.log({"loss/validation": loss}, step=step)
        accelerator.print(f"\nvalidation loss at step {step}: {loss:.5f}")
        return loss


def validation_loss(dataset: Any, unet: Any, conditioner: Any, noise_scheduler: Any, dtype: Any, device: Any,
                    seed: int, noise_settings: Any, alphas_cumprod: Any,
                    timesteps: tuple[int, ...] = (100, 300, 500, 700, 900)) -> float:
    """Mean loss over every held-out batch at each of ``timesteps``, with noise drawn from ``seed``.

    Fixed timesteps and noise make successive measurements comparable: only the LoRA changed.
    """
    import torch

    from sd_scripts_compat.caching.latent_cache import encode_images
    from sd_scripts_compat.dataset.train_dataset import BucketBatchSampler, make_dataloader
    from sd_scripts_compat.training.objectives import diffusion_target, per_sample_loss

    was_training = unet.training
    unet.eval()
    total, count = torch.zeros((), device=device), 0
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for index, batch in enumerate(make_dataloader(dataset, BucketBatchSampler(dataset, epoch=0))):
            batch = _to_device(batch, device)
            if "latents" in batch:
                latents = batch["latents"].to(dtype)
            else:
                vae = conditioner.bundle.vae
                seeds = [seed + 7919 * index + i for i in range(batch["images"].shape[0])]
                latents = encode_images(vae, batch["images"], scaling_factor=vae.config.scaling_factor,
                                        noise_seeds=seeds).to(dtype)
            hidden, added = conditioner.condition(batch, train=False)
            for t in timesteps:
                noise = torch.randn(latents.shape, generator=generator, device=device, dtype=latents.dtype)
                steps = torch.full((latents.shape[0],), t, device=device, dtype=torch.long)
                noisy = noise_scheduler.add_noise(latents, noise, steps)
                with torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype != torch.float32):
                    prediction = unet(noisy, steps, hidden, added_cond_kwargs=added).sample
                target = diffusion_target(noise_scheduler, latents, noise, steps, noise_settings.v_parameterization)
                ones = torch.ones(latents.shape[0], device=device)
                total += per_sample_loss(prediction, target, steps, ones, alphas_cumprod, noise_settings).sum()
                count += latents.shape[0]
    unet.train(was_training)
    return (total / max(count, 1)).item()


if __name__ == "__main__":
    raise SystemExit(main())
