"""The LoRA training run as a recipe: setup steps that each return an explicit object, then the loop.

``train`` reads top to bottom: :func:`setup_process` (accelerator, device, dtypes, paths, seed),
:func:`load_model`, :func:`build_data`, :func:`cache_inputs` (latents, text-encoder outputs),
:func:`build_network`, :func:`build_optimization` (optimizer, schedule, loss scale, step counts),
:func:`build_objective`, :func:`resume`, then :func:`run_loop` and the ending (OOM, Ctrl-C or done).
The order of the steps is the order of their effects on the RNG and the device, so it is fixed.

The hot path does no per-step host syncs (the step losses and gradient norms stay on the device and
are read at the first step, when the progress bar refreshes (about every 2 s) and before a save: see
``training.stability``, which also stops an unstable run), feeds cached latents when asked, and copies batches with
pinned memory and ``non_blocking``. Events go through ``sd_scripts_compat.facts.contract.write_event``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import secrets
import sys
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sd_scripts_compat.facts.contract import (
    COLLECTIVE_EXIT_CODE,
    COMM,
    CONTROL_FILE,
    DIVERGED,
    DIVERGED_EXIT_CODE,
    DONE,
    OOM,
    OOM_EXIT_CODE,
    PROGRESS,
    collective_failure,
    error_summary,
    is_oom_error,
    memory_figures,
    oom_point_mib,
    write_event,
)
from sd_scripts_compat.facts.errors import UserError, say
from sd_scripts_compat.facts.families import FamilySpec
from sd_scripts_compat.runtimes import TextOptions
from sd_scripts_compat.training.checkpoints import Checkpointer, RunPaths, SavePolicy
from sd_scripts_compat.training.comm_profile import CommProfile
from sd_scripts_compat.training.compiled_blocks import (
    CompiledBlocks,
    compile_blocks,
    compile_summary,
    report_compiles,
)
from sd_scripts_compat.training.conditioning import Conditioner
from sd_scripts_compat.training.devices import (
    average_gradients,
    channels_last_for,
    cuda_context_mib,
    free_device_memory,
    peak_memory_mib,
    place,
    resident_memory_mib,
    to_channels_last,
    to_device,
    unwrap_optimizer,
)
from sd_scripts_compat.training.emulated_card import EmulatedCard, optimizer_tensors
from sd_scripts_compat.training.faults import FaultPlan
from sd_scripts_compat.training.live_changes import ControlFile, reset_peak, set_checkpointing
from sd_scripts_compat.training.monitor import start_monitor
from sd_scripts_compat.training.optimizer_sharding import agreed_by_main, local_optimizer
from sd_scripts_compat.training.phase_report import PhaseReporter, size_on_disk
from sd_scripts_compat.training.phase_timer import PhaseTimer, tensorboard_scalars
from sd_scripts_compat.training.precision import DynamicLossScale
from sd_scripts_compat.training.stability import Diverged, StabilityGuard
from sd_scripts_compat.training.stopping import StopSignals
from sd_scripts_compat.training.validation import ValidationRun

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from accelerate import Accelerator
    from diffusers import ModelMixin
    from torch.distributed.device_mesh import DeviceMesh
    from tqdm.auto import tqdm

    from sd_scripts_compat.config.training_config import TrainingConfig
    from sd_scripts_compat.dataset.train_dataset import BucketBatchSampler, TrainDataset
    from sd_scripts_compat.facts.dataset_spec import DatasetSpec
    from sd_scripts_compat.models.build import ModelBundle
    from sd_scripts_compat.network.lora import LoRANetwork
    from sd_scripts_compat.network.lycoris import LycorisNetwork
    from sd_scripts_compat.runtimes import FamilyRuntime
    from sd_scripts_compat.runtimes import Objective as FamilyObjective
    from sd_scripts_compat.training.block_swap import BlockSwap
    from sd_scripts_compat.training.faults import FaultyObjective
    from sd_scripts_compat.training.train_state import TrainCounters

    # what the loop calls ``forward`` / ``loss`` / ``fixed_forward`` on (the family's objective, maybe with faults)
    Objective = FamilyObjective | FaultyObjective

PROGRESS_EVERY_SECONDS = 2.0  # the loop's one host sync: progress bar, progress.json, instability checks
TIMING_WARMUP_STEPS = 2


# ---- 1. Process, precision, output folder ---------------------------------------------------------

@dataclass(frozen=True)
class Process:
    """This process's place in the run: accelerate's state, dtypes, output paths, seed, clock."""

    accelerator: Accelerator
    device: torch.device
    seed: int
    weight_dtype: torch.dtype
    save_dtype: torch.dtype
    paths: RunPaths
    started: float
    faults: FaultPlan | None = None  # SD_COMPAT_INJECT_OOM / _NAN (tests): wraps the objective, if anything
    card: EmulatedCard | None = None  # SD_COMPAT_EMULATED_CARD_MIB (tests, benches): the steps' tensors on a card
    cuda_context_mib: float | None = None  # the CUDA context as measured at start (devices.cuda_context_mib)

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process


def setup_process(config: TrainingConfig) -> Process:
    import datetime

    import torch
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, set_seed

    from sd_scripts_compat.facts.sample_prompts import read_sample_prompts
    from sd_scripts_compat.training.host_allocator import keep_freed_host_memory
    from sd_scripts_compat.training.optim import check_optimizer_settings
    from sd_scripts_compat.training.optimizer_sharding import check_state_sharding
    from sd_scripts_compat.training.precision import fp8_supported
    from sd_scripts_compat.training.sharding import check_sharding

    check_optimizer_settings(config.optimizer_type or "AdamW", config.learning_rate, config.optimizer_args)
    card = EmulatedCard.from_env()  # a bad size is said before anything is made
    if config.sample_prompts:  # read now: a bad line is said before the model loads, not at the first sample
        read_sample_prompts(config.sample_prompts, (512, 512))

    started = time.time()
    paths = RunPaths.create(config)
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),  # several CPU processes (accelerate launch / torchrun) then use gloo
        mixed_precision=config.mixed_precision,
        log_with=config.log_with if config.logging_dir else None,
        project_dir=config.logging_dir,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(minutes=config.ddp_timeout))]
        if config.ddp_timeout else None,  # as sd-scripts' --ddp_timeout
    )
    check_sharding(config.fsdp, world=accelerator.num_processes, blocks_to_swap=config.blocks_to_swap,
                   compiled=bool(config.torch_compile), offload=config.fsdp_offload_params,
                   shard_size=config.fsdp_shard_size)
    check_state_sharding(config.shard_optimizer_state, accelerator.num_processes, config.optimizer_type or "AdamW")
    if (config.fp8_base or config.fp8_base_unet) and not fp8_supported(accelerator.device):
        raise UserError("fp8_base needs a GPU with compute capability 8.0 or newer (RTX 30 series on); remove "
                        "fp8_base")
    if accelerator.device.type == "cpu":  # the step's activations are host memory: reuse, not fault in, each step
        keep_freed_host_memory()
    seed = config.seed if config.seed is not None else 42
    set_seed(seed)
    weight_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(accelerator.mixed_precision, torch.float32)
    if accelerator.device.type == "cpu" and weight_dtype == torch.float16:
        weight_dtype = torch.float32  # accelerate keeps fp16 "mixed precision" on CPU as fp32
    save_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "float": torch.float32}.get(
        config.save_precision or "float", torch.float32)
    return Process(accelerator=accelerator, device=accelerator.device, seed=seed, weight_dtype=weight_dtype,
                   save_dtype=save_dtype, paths=paths, started=started,
                   faults=FaultPlan.from_env(paths.events_dir or paths.output_dir), card=card,
                   cuda_context_mib=cuda_context_mib(accelerator.device))


# ---- 2. Base model ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Model:
    bundle: ModelBundle
    family: FamilySpec
    runtime: FamilyRuntime  # what the family does its own way: encoding, conditioning, objective, sampling
    vae_scale: int  # pixels per latent pixel
    v_parameterization: bool
    train_text_encoder: bool  # whether the LoRA has text-encoder modules that learn


def load_model(config: TrainingConfig, process: Process, *, sdxl: bool) -> Model:
    """The base model, read into the dtypes it trains in. With ``fsdp`` the processes read it in turn, each
    sharding its denoiser before the next begins (``training.sharding.in_turn``): the machine's RAM holds one
    whole denoiser at a time, not one per process. The mesh is made first, by every process together (a
    hybrid_shard mesh's groups are collectives of all of them)."""
    if not config.fsdp:
        return _read_model(config, process, sdxl=sdxl)
    from sd_scripts_compat.training.sharding import in_turn, process_mesh

    mesh = process_mesh(process.device, config.fsdp_shard_size)
    return in_turn(process.world, process.rank,
                   lambda: _sharded(config, process, mesh, _read_model(config, process, sdxl=sdxl)))


def _sharded(config: TrainingConfig, process: Process, mesh: DeviceMesh, model: Model) -> Model:
    """``model`` with its denoiser sharded across the run's processes: on the host until ``fully_shard`` moves one
    block at a time to the card and keeps this process's share (a model larger than one card loads), freeing the
    whole copy in host RAM."""
    import torch

    from sd_scripts_compat.training.precision import store_frozen_weights_in_fp8
    from sd_scripts_compat.training.sharding import held_bytes, shard_denoiser

    unet = model.bundle.unet
    place(unet, "cpu", process.weight_dtype)
    if config.fp8_base or config.fp8_base_unet:  # each process's share and each gather in float8 (1 byte)
        store_frozen_weights_in_fp8(unet, process.weight_dtype)
    units = shard_denoiser(unet, model.family, str(config.fsdp), mesh, offload=config.fsdp_offload_params)
    held, whole = held_bytes(unet)
    card = f"; the card's peak while sharding {torch.cuda.max_memory_allocated() / 2**20:.2f} MiB" \
        if process.device.type == "cuda" else ""
    group = mesh.size(mesh.ndim - 1)
    across = f"{group} processes" + (f" in each of {process.world // group} groups" if group < process.world else "")
    process.accelerator.print(f"fsdp {config.fsdp}: the {model.family.description} sharded across {across} "
                              f"({units} blocks and the rest as one unit; loaded one process at a time): "
                              f"each holds {held / 2**20:.2f} of its {whole / 2**20:.2f} MiB of weights"
                              f"{' in host RAM' if config.fsdp_offload_params else ''}; the LoRA whole on each{card}")
    return model


def _read_model(config: TrainingConfig, process: Process, *, sdxl: bool) -> Model:
    from sd_scripts_compat.models.weight_check import check_finite
    from sd_scripts_compat.runtimes import load_base_model, runtime_for

    base = config.pretrained_model_name_or_path
    if not base:
        raise UserError("pretrained_model_name_or_path: not given; name the base model (a .safetensors file, a "
                        "diffusers folder or builtin:<id>) in the config or on the command line")
    parts = {"clip_l": config.clip_l, "clip_g": config.clip_g, "t5xxl": config.t5xxl, "ae": config.ae,
             "vae": config.vae, "t5xxl_tokenizer": config.t5xxl_tokenizer}  # FLUX.1's and SD3's separate files
    # read straight into the dtypes the modules train in: loading holds the modules, never the file beside them
    bundle = load_base_model(base, allow_pickle=config.allow_pickle,
                             family=_stated_family(config, sdxl), dtype=process.weight_dtype,
                             vae_dtype=vae_dtype(config, process), **{k: v for k, v in parts.items() if v})
    family = bundle.family
    sources = [base, config.ae or config.vae or base,
               *(getattr(config, te.file_option or "", None) or base for te in family.text_encoders)]
    for source, module in zip(sources, [bundle.unet, bundle.vae, *bundle.text_encoders], strict=True):
        check_finite(source, f"the weights of its {type(module).__name__}", module.state_dict().items())
    vae_scale = family.latent_downsample
    if family.flux_model_type and config.model_type != family.flux_model_type:
        raise UserError(f"{config.pretrained_model_name_or_path}: a {family.description} model; set model_type = "
                        f"{family.flux_model_type!r} (sd-scripts' --model_type)")
    if family.script != _script(config, sdxl):
        raise UserError(f"{config.pretrained_model_name_or_path}: this is a {family.description} model; "
                        f"train it with {family.engine_module}")
    if config.xformers:
        _enable_xformers(bundle.unet)
    elif config.sdpa is not False and family.unet["_class_name"].startswith("UNet"):  # FLUX's processor is SDPA
        from diffusers.models.attention_processor import AttnProcessor2_0

        bundle.unet.set_attn_processor(AttnProcessor2_0())
    return Model(bundle=bundle, family=family, runtime=runtime_for(family), vae_scale=vae_scale,
                 v_parameterization=bool(config.v_parameterization) or family.v_parameterization,
                 train_text_encoder=not config.network_train_unet_only and config.text_encoders_lr != 0)


# ---- 3. Datasets -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Data:
    spec: DatasetSpec
    train: TrainDataset
    validation: TrainDataset | None

    @property
    def all(self) -> list[TrainDataset]:
        return [d for d in (self.train, self.validation) if d is not None]


def build_data(config: TrainingConfig, process: Process, family: FamilySpec) -> Data:
    """The datasets (image sizes read, buckets assigned; nothing decoded yet), for the model's family."""
    from sd_scripts_compat.config.training_config import single_dataset
    from sd_scripts_compat.dataset.train_dataset import build_dataset, build_validation_dataset

    spec = single_dataset(config, default_resolution=(family.resolution, family.resolution))
    _check_size_steps(spec, family)
    train = build_dataset(spec, seed=process.seed, prior_loss_weight=config.prior_loss_weight)
    validation = build_validation_dataset(spec, seed=process.seed, prior_loss_weight=config.prior_loss_weight) \
        if spec.validation_split > 0 else None
    return Data(spec=spec, train=train, validation=validation)


def _check_size_steps(spec: DatasetSpec, family: FamilySpec) -> None:
    """The family's own size rule (``FamilySpec.resolution_problem``, which the planner applies too); buckets
    in steps of VAE scale x patch (FLUX.1's 2x2 tokens: 16 px)."""
    problem = family.resolution_problem(*spec.resolution)
    if problem is not None:
        raise UserError(f"resolution: {problem}")
    step = family.bucket_step
    if spec.enable_bucket and spec.bucket_reso_steps % step:
        raise UserError(f"bucket_reso_steps = {spec.bucket_reso_steps}: this model needs a multiple of {step}")


# ---- 4. Caching: latents, then text-encoder outputs; encoders no longer needed leave the device ----

@dataclass(frozen=True)
class Inputs:
    """How batches become UNet inputs: from caches or live, and the conditioner that reads them."""

    cached_latents: bool
    cached_text: bool
    conditioner: Conditioner


def cache_inputs(config: TrainingConfig, process: Process, model: Model, data: Data,
                 progress: Callable[[int], None] | None = None) -> Inputs:
    """Latents, then text-encoder outputs, when cached; ``progress(n)``: n more images done (phase.json)."""
    options = TextOptions(max_token_length=config.max_token_length, clip_skip=config.clip_skip,
                          dtype=process.weight_dtype, apply_t5_attn_mask=bool(config.apply_t5_attn_mask),
                          apply_lg_attn_mask=bool(config.apply_lg_attn_mask),
                          t5xxl_max_token_length=config.t5xxl_max_token_length or model.family.t5xxl_max_token_length)
    conditioner = Conditioner(model.bundle, model.runtime, options)
    cached_latents = _cache_latents(config, process, model, data, progress)
    cached_text = _cache_text(config, process, model, data, conditioner, progress)
    return Inputs(cached_latents=cached_latents, cached_text=cached_text, conditioner=conditioner)


def vae_dtype(config: TrainingConfig, process: Process) -> torch.dtype:
    """The VAE encodes in fp32 on a CPU or with ``no_half_vae``, else in the weight dtype (as in sd-scripts)."""
    import torch

    return torch.float32 if config.no_half_vae or process.device.type == "cpu" else process.weight_dtype


def _cache_latents(config: TrainingConfig, process: Process, model: Model, data: Data,
                   progress: Callable[[int], None] | None) -> bool:

    from sd_scripts_compat.caching.latent_cache import cache_latents, offload

    vae = model.bundle.vae
    dtype = vae_dtype(config, process)
    place(vae, process.device, dtype)
    if not (config.cache_latents or config.cache_latents_to_disk):
        return False
    encoded = reused = 0
    for dataset in data.all:
        stats = cache_latents(dataset, vae, device=process.device, dtype=dtype,
                              vae_batch_size=config.vae_batch_size, to_disk=bool(config.cache_latents_to_disk),
                              is_main_process=process.is_main, cache_dir=cache_dir(process), progress=progress)
        encoded, reused = encoded + stats.encoded, reused + stats.reused
    if config.cache_latents_to_disk:
        process.accelerator.print(f"latent cache: {encoded} encoded, {reused} reused from disk")
    process.accelerator.wait_for_everyone()  # other processes read the files the main process wrote
    offload(vae)
    return True


def _cache_text(config: TrainingConfig, process: Process, model: Model, data: Data, conditioner: Conditioner,
                progress: Callable[[int], None] | None) -> bool:
    from sd_scripts_compat.caching.latent_cache import offload
    from sd_scripts_compat.caching.text_cache import cache_text_encoder_outputs

    for encoder in model.bundle.text_encoders:
        place(encoder, process.device, process.weight_dtype)
    cached = bool(config.cache_text_encoder_outputs or config.cache_text_encoder_outputs_to_disk)
    if not cached and not model.train_text_encoder and _captions_fixed(data.all):
        # A frozen text encoder gives a fixed caption the same output at every step: encode each caption
        # once, in memory (sd-scripts re-encodes every step for SD 1.x/2.x; the outputs are the same).
        cached = True
        process.accelerator.print("text encoders are not trained and captions are fixed: "
                                  "their outputs are cached in memory")
    if not cached:
        return False
    length, variant = model.runtime.text_cache_key(conditioner.options)  # what the cache files record
    encoded = reused = 0
    for dataset in data.all:
        stats = cache_text_encoder_outputs(dataset, model.bundle, device=process.device, dtype=process.weight_dtype,
                                           to_disk=bool(config.cache_text_encoder_outputs_to_disk),
                                           max_token_length=length, clip_skip=config.clip_skip,
                                           is_main_process=process.is_main, cache_dir=cache_dir(process),
                                           encode=conditioner.encode, variant=variant, progress=progress)
        encoded, reused = encoded + stats.encoded, reused + stats.reused
    if config.cache_text_encoder_outputs_to_disk:
        process.accelerator.print(f"text-encoder cache: {encoded} captions encoded, {reused} images reused from disk")
    process.accelerator.wait_for_everyone()
    for encoder in model.bundle.text_encoders:
        offload(encoder)
    return True


# ---- 5. UNet precision and the LoRA network ---------------------------------------------------------

@dataclass(frozen=True)
class Network:
    network: LoRANetwork | LycorisNetwork  # hooked into the UNet (and text encoders)
    trainable: list[torch.nn.Parameter] = field(default_factory=list)
    block_swap: BlockSwap | None = None  # when blocks_to_swap (FLUX.1)
    compiled: CompiledBlocks | None = None  # when torch_compile
    channels_last: bool = False  # a conv UNet's weights stored channels_last (devices.channels_last_for)


def build_network(config: TrainingConfig, process: Process, model: Model) -> Network:
    import torch

    from sd_scripts_compat.training.precision import store_frozen_weights_in_fp8

    unet = model.bundle.unet
    use_fp8 = bool(config.fp8_base or config.fp8_base_unet)
    block_swap = None
    if config.blocks_to_swap:
        block_swap = _swap_blocks(config, process, model, use_fp8)
    elif not config.fsdp:  # a sharded denoiser holds its share already (load_model)
        place(unet, process.device, process.weight_dtype)
        if use_fp8:
            store_frozen_weights_in_fp8(unet, process.weight_dtype)
    if config.gradient_checkpointing:
        set_checkpointing(unet, _learning_encoders(model), on=True, offload=bool(config.cpu_offload_checkpointing),
                          transformer=model.family.is_transformer)
    network = _create_network(config, model)
    network.apply_to()
    lora_dtype = {(True, False): torch.float16, (False, True): torch.bfloat16}.get(
        (bool(config.full_fp16), bool(config.full_bf16)), torch.float32)
    network.to(process.device, dtype=lora_dtype)
    network.train()
    channels_last = channels_last_for(process.device, process.weight_dtype, not model.family.is_transformer)
    if channels_last:
        to_channels_last(unet)
    # after the LoRA modules are in place: each block is traced with its adapters
    compiled = compile_blocks(unet, config.dynamo_backend) if config.torch_compile else None
    return Network(network=network, trainable=[p for p in network.parameters() if p.requires_grad],
                   block_swap=block_swap, compiled=compiled, channels_last=channels_last)


def _learning_encoders(model: Model) -> list[Any]:
    """The text encoders that train: gradient checkpointing concerns them too."""
    return list(model.bundle.text_encoders) if model.train_text_encoder else []


def _swap_blocks(config: TrainingConfig, process: Process, model: Model, use_fp8: bool) -> BlockSwap | None:
    """blocks_to_swap: cast (and fp8) on the host, then move all but the swapped blocks to the device."""
    from sd_scripts_compat.training.block_swap import check_blocks_to_swap, enable_flux_block_swap, place_except_swapped
    from sd_scripts_compat.training.precision import store_frozen_weights_in_fp8

    unet = model.bundle.unet
    check_blocks_to_swap(model.family, config.blocks_to_swap)  # one line before any copy
    place(unet, "cpu", process.weight_dtype)
    if use_fp8:
        store_frozen_weights_in_fp8(unet, process.weight_dtype)
    swap = enable_flux_block_swap(unet, config.blocks_to_swap, process.device, family=model.family)
    place_except_swapped(unet, swap, process.device, process.weight_dtype)
    return swap


def _create_network(config: TrainingConfig, model: Model) -> LoRANetwork | LycorisNetwork:
    """A new LoRA (or LyCORIS network), or one shaped (dim_from_weights) or initialised from ``network_weights``."""
    from sd_scripts_compat.models.weight_check import check_finite
    from sd_scripts_compat.network.lora import create_network, create_network_from_weights
    from sd_scripts_compat.network.lora_file import read_lora_file

    if config.network_args.lycoris is not None:
        from sd_scripts_compat.network.lycoris import create_lycoris_network

        lycoris = create_lycoris_network(model.bundle, network_dim=config.network_dim or 4,
                                         network_alpha=config.network_alpha, dropout=config.network_dropout,
                                         args=config.network_args, train_text_encoder=model.train_text_encoder)
        if config.network_weights:
            lycoris.apply_to()  # lycoris registers its modules when applied
            state = read_lora_file(config.network_weights, lycoris=True)[0]
            check_finite(config.network_weights, "the network weights to start from", state.items(), sample=None)
            lycoris.load_kohya_state_dict(state, source=config.network_weights)
        return lycoris
    if config.network_weights and config.dim_from_weights:
        check_finite(config.network_weights, "the LoRA weights to start from",
                     read_lora_file(config.network_weights)[0].items(), sample=None)
        return create_network_from_weights(model.bundle, config.network_weights, train_unet=True,
                                           train_text_encoder=model.train_text_encoder, args=config.network_args)
    network = create_network(model.bundle, network_dim=config.network_dim or 4,
                             network_alpha=config.network_alpha if config.network_alpha is not None else 1.0,
                             dropout=config.network_dropout, args=config.network_args, train_unet=True,
                             train_text_encoder=model.train_text_encoder)
    if config.network_weights:
        state = read_lora_file(config.network_weights)[0]
        check_finite(config.network_weights, "the LoRA weights to start from", state.items(), sample=None)
        network.load_kohya_state_dict(state)
    return network


# ---- 6. Optimizer, schedule, step counts; the diffusion objective ------------------------------------

@dataclass(frozen=True)
class Optimization:
    optimizer: torch.optim.Optimizer  # accelerate-wrapped unless full_fp16 (then the loss scale is ours)
    description: str  # ss_optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    loss_scale: DynamicLossScale | None
    accumulation: int
    batches_per_epoch: int  # micro-batches per epoch for this process
    max_train_steps: int
    total_epochs: int
    warmup_steps: int
    unet_group: int = -1  # the first param group of the UNet / transformer: its rate is the one shown


def build_optimization(config: TrainingConfig, process: Process, network: Network, data: Data) -> Optimization:
    from sd_scripts_compat.training.optim import make_lr_scheduler, make_optimizer

    param_groups = network.network.prepare_optimizer_params(config.text_encoders_lr, config.unet_lr,
                                                            config.learning_rate)
    optimizer, description = make_optimizer(config.optimizer_type or "AdamW", param_groups, config.learning_rate,
                                            config.optimizer_args, shard_state=config.shard_optimizer_state)
    if config.shard_optimizer_state:
        from sd_scripts_compat.training.optimizer_sharding import owned_share

        owned, every = owned_share(optimizer)
        process.accelerator.print(f"shard_optimizer_state: the optimizer's state split across {process.world} "
                                  f"processes by parameter; the main process keeps that of {owned:,} of the LoRA's "
                                  f"{every:,} elements")
    accumulation = max(1, config.gradient_accumulation_steps)
    batches_per_epoch = data.train.num_batches(process.world)
    steps_per_epoch = max(1, math.ceil(batches_per_epoch / accumulation))
    max_train_steps = steps_per_epoch * config.max_train_epochs if config.max_train_epochs else config.max_train_steps
    data.train.max_train_steps = max_train_steps  # token_warmup_step given as a fraction needs it
    warmup_steps = config.warmup_steps(max_train_steps)
    lr_scheduler = make_lr_scheduler(config.lr_scheduler, optimizer, num_training_steps=max_train_steps,
                                     num_warmup_steps=warmup_steps, num_cycles=config.lr_scheduler_num_cycles or 1,
                                     power=config.lr_scheduler_power or 1.0, learning_rate=config.learning_rate,
                                     scheduler_args=config.lr_scheduler_args)
    unet_group = next((i for i, group in enumerate(param_groups) if group.get("part") == "unet"), -1)
    loss_scale = DynamicLossScale() if config.full_fp16 else None
    if loss_scale is None:  # GradScaler for fp16 mixed precision lives here; a sharded optimizer's state is not
        # whole in any process to be moved (nor yet made): accelerate's device placement would ask for it
        optimizer = process.accelerator.prepare_optimizer(optimizer, device_placement=not config.shard_optimizer_state)
    return Optimization(optimizer=optimizer, description=description, lr_scheduler=lr_scheduler,
                        loss_scale=loss_scale, accumulation=accumulation, batches_per_epoch=batches_per_epoch,
                        max_train_steps=max_train_steps, total_epochs=math.ceil(max_train_steps / steps_per_epoch),
                        unet_group=unet_group,
                        warmup_steps=warmup_steps)


def build_objective(config: TrainingConfig, process: Process, model: Model) -> FamilyObjective:
    """The family's training objective, from its runtime: DDPM noise prediction (SD), flow matching (FLUX.1,
    SD3); each gives the loop ``forward`` / ``loss`` / ``fixed_forward``."""
    return model.runtime.build_objective(config, process.device, model.bundle, model.v_parameterization)


# ---- 7. Resume -------------------------------------------------------------------------------------

def resume(config: TrainingConfig, process: Process, network: Network, optimization: Optimization,
           data: Data) -> TrainCounters:
    """The counters to start from: zero, or those of the ``resume`` state (whose weights, optimizer,
    schedule and RNG states are loaded here)."""
    from sd_scripts_compat.models.weight_check import check_finite
    from sd_scripts_compat.training.train_state import TrainCounters, load_train_state, restore_rng_state

    if not config.resume:
        return TrainCounters()
    state = load_train_state(Path(config.resume))
    check_finite(config.resume, "the saved LoRA weights", state.lora_state.items(), sample=None)
    network.network.load_kohya_state_dict(state.lora_state)
    optimizer = unwrap_optimizer(optimization.optimizer)
    configured_lrs = [float(lr) for lr in optimization.lr_scheduler.base_lrs]
    optimizer.load_state_dict(state.optimizer_state)
    optimization.lr_scheduler.load_state_dict(state.lr_scheduler_state)
    _follow_configured_rates(optimizer, optimization.lr_scheduler, configured_lrs)
    restore_rng_state(state.rng)
    counters = state.counters
    batch_size = data.spec.batch_size
    saved_batch = int(counters.extra.get("micro_batch", batch_size))
    if saved_batch != batch_size:  # the watchdog changed the micro-batch: skip the samples already seen
        counters.rebatch(saved_batch, batch_size)
    process.accelerator.print(f"resumed from {config.resume} at step {counters.global_step} "
                              f"(epoch {counters.epoch + 1})")
    return counters


def _follow_configured_rates(optimizer: torch.optim.Optimizer, lr_scheduler: torch.optim.lr_scheduler.LRScheduler,
                             configured_lrs: list[float]) -> None:
    """The state's learning rates give way to this run's config (a resume after the watchdog lowered them).

    Loading a state restores each param group's ``lr`` / ``initial_lr`` and the schedule's ``base_lrs``
    as they were when it was saved; the schedule's shape (warm-up, decay) comes from this run's config,
    since only its step count is in the state. Here the configured base rates are put back and the
    current rate recomputed for the loaded step (``last_epoch``), exactly as an uninterrupted run with
    this config would have it: with unchanged rates the values are the same floats as before.
    """
    lr_scheduler.base_lrs = list(configured_lrs)
    for group, lr in zip(optimizer.param_groups, configured_lrs):
        group["initial_lr"] = lr
    lr_scheduler.last_epoch -= 1
    lr_scheduler.step()  # recomputes every group's lr from base_lrs for last_epoch + 1, the loaded step


# ---- 8. What the run reports and writes ---------------------------------------------------------------

@dataclass(frozen=True)
class Report:
    """The ``settings`` and ``resolved`` blocks of the oom and done events (the ladder steps down from them)."""

    settings: dict[str, Any]
    resolved: dict[str, Any]


def report_run(config: TrainingConfig, process: Process, data: Data, inputs: Inputs) -> Report:
    from sd_scripts_compat.config.resolved_run import dataset_report, resolved_settings

    resolved = {"datasets": [dataset_report(data.spec)], "latents_cached": inputs.cached_latents,
                "text_encoder_outputs_cached": inputs.cached_text,
                "weight_dtype": str(process.weight_dtype).replace("torch.", "")}
    return Report(settings=resolved_settings(config, data.spec).to_event(), resolved=resolved)


def _network_args_written(config: TrainingConfig) -> dict[str, Any] | None:
    """``ss_network_args`` as sd-scripts' train_network writes it: the given entries, plus ``dropout`` (its
    network_dropout, for LyCORIS) where they have none and the network is not sized from its weights."""
    entries: dict[str, Any] = dict(config.network_args.entries)
    if entries and "dropout" not in entries and not config.dim_from_weights:
        entries["dropout"] = config.network_dropout
    return entries or None


def build_checkpointer(config: TrainingConfig, process: Process, model: Model, data: Data, inputs: Inputs,
                       network: Network, optimization: Optimization, report: Report,
                       guard: StabilityGuard | None = None) -> Checkpointer:
    from sd_scripts_compat.network.kohya_keys import dataset_keys, file_keys, option_keys, option_value
    from sd_scripts_compat.network.lora_file import TrainingFacts

    retries = _read_retry_log(config.autotune_retry_log)
    batch_size = data.spec.batch_size
    given = partial(option_value, config)  # each value in the form sd-scripts' args hold it
    facts = TrainingFacts(
        output_name=process.paths.output_name, network_dim=config.network_dim,
        network_alpha=config.raw.get("network_alpha", 1),  # as sd-scripts' args hold it: a TOML integer stays one
        learning_rate=given("learning_rate"), optimizer=optimization.description, resolution=data.spec.resolution,
        training_started_at=process.started, session_id=secrets.randbits(31),  # ss_session_id, as sd-scripts
        network_args=_network_args_written(config), network_dropout=given("network_dropout"),
        network_module=config.network_module,
        unet_lr=given("unet_lr"), text_encoder_lr=config.text_encoders_lr, lr_scheduler=config.lr_scheduler,
        lr_warmup_steps=optimization.warmup_steps, mixed_precision=process.accelerator.mixed_precision,
        num_train_images=data.train.num_train_images, num_reg_images=data.train.num_reg_images,
        num_batches_per_epoch=optimization.batches_per_epoch, num_epochs=optimization.total_epochs,
        max_train_steps=optimization.max_train_steps, batch_size_per_device=batch_size,
        total_batch_size=batch_size * process.world * optimization.accumulation,
        gradient_checkpointing=bool(config.gradient_checkpointing),
        gradient_accumulation_steps=optimization.accumulation, max_grad_norm=given("max_grad_norm"),
        seed=process.seed, clip_skip=config.clip_skip, max_token_length=config.max_token_length,
        cache_latents=inputs.cached_latents, noise_offset=given("noise_offset"), min_snr_gamma=given("min_snr_gamma"),
        sd_model_name=Path(config.pretrained_model_name_or_path or "").name,
        tag_frequency=data.train.tag_frequencies, dataset_dirs=data.train.dataset_dirs(),
        training_comment=config.training_comment,
        kohya_keys={**option_keys(config, data.validation.num_train_images if data.validation else 0),
                    **dataset_keys(config, data.train), **file_keys(config)},
        extra={**({"ss_autotune_retries": json.dumps(retries)} if retries else {}),
               **model.runtime.file_metadata(config)},
    )
    return Checkpointer(paths=process.paths, policy=SavePolicy.from_config(config), network=network.network,
                        optimizer=unwrap_optimizer(optimization.optimizer), lr_scheduler=optimization.lr_scheduler,
                        settings=report.settings, micro_batch=batch_size, facts=facts, family=model.family,
                        save_dtype=process.save_dtype, is_main_process=process.is_main, guard=guard)


# ---- 9. The loop -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Recipe:
    """Everything the loop reads, built once by the setup steps."""

    config: TrainingConfig
    process: Process
    model: Model
    data: Data
    inputs: Inputs
    network: Network
    optimization: Optimization
    objective: Objective
    report: Report
    checkpointer: Checkpointer
    validation: ValidationRun | None
    guard: StabilityGuard
    stops: StopSignals | None = None  # SIGINT / SIGTERM: stop at the next optimizer-step boundary
    control: ControlFile = field(default_factory=lambda: ControlFile(None))  # the supervisor's in-process changes
    phases: PhaseTimer = field(default_factory=lambda: PhaseTimer("cpu"))  # where the time goes (done.json)
    comm: CommProfile = field(default_factory=lambda: CommProfile(1, "cpu", 0))  # several processes' collectives

    def on_card(self) -> contextlib.AbstractContextManager[Any]:
        """A step's work counted on the emulated card, when there is one (``training.emulated_card``)."""
        card = self.process.card
        return card.active() if card is not None else contextlib.nullcontext()

    def peak_memory_mib(self) -> float:
        """The emulated card's peak, else the device's (CUDA reserved, or the process's peak RSS)."""
        card = self.process.card
        return card.peak_mib if card is not None else peak_memory_mib(self.process.device)

    def resident_memory_mib(self) -> float | None:
        """What stays on the card between steps, read at a step boundary (the emulated card's count, CUDA's
        allocated bytes; None on a CPU): with the peak, it says which part of a prediction was off."""
        card = self.process.card
        return card.counter.current / 2**20 if card is not None else resident_memory_mib(self.process.device)

    def memory_figures(self) -> dict[str, float]:
        card, context = self.process.card, self.process.cuda_context_mib
        return {**memory_figures(), **(card.figures() if card is not None else {}),
                **({"cuda_context_mib": context} if context is not None else {})}


@dataclass
class LoopState:
    """What the loop carries from step to step (this session only)."""

    last_report: float
    last_state_save: float
    session_started: float = 0.0
    peak_memory_mib: float = 0.0
    control: int = 0  # the id of the supervisor's last change applied in the process (progress.json says it)
    rebatch: tuple[int, int] | None = None  # (micro-batch, accumulation) asked in the process, from the next step
    collective: dict[str, str] | None = None  # several processes: a collective failed ({"kind", "message"})
    resident_memory_mib: float | None = None  # at the last progress report (a step boundary)
    largest_batch: tuple[int, int, int, int] = (0, 0, 0, 0)  # (pixels, micro-batch, width, height) trained so far
    largest_bucket: tuple[int, int, int] = (0, 0, 0)  # (micro-batch, width, height) of the data's largest bucket
    step_ended_at: list[float] = field(default_factory=list)  # host clock at each optimizer step (done.json)
    oom: dict[str, Any] | None = None
    interrupted: bool = False
    diverged: dict[str, Any] | None = None  # the guard's report: a non-finite or diverging loss


def train(config: TrainingConfig, *, sdxl: bool) -> int:
    """One training run; returns the process exit code (0, OOM_EXIT_CODE, DIVERGED_EXIT_CODE, or INTERRUPTED_EXIT_CODE /
    TERMINATED_EXIT_CODE after SIGINT / SIGTERM, see ``training.stopping``)."""
    fresh = [Path(d) for d in (config.output_dir or "output", config.autotune_state_dir) if d and not Path(d).exists()]
    with StopSignals.installed() as stops:
        try:
            code = _train(config, sdxl=sdxl, stops=stops)
            if code == 0:  # finished: every process is past its last collective
                _leave_process_group()
            return code
        except UserError:  # refused (a model it cannot load, bad data): the folders it made for outputs go again
            for folder in fresh:
                with contextlib.suppress(OSError):  # another process of the run may remove it (or write) first
                    if folder.is_dir() and not any(folder.iterdir()):
                        folder.rmdir()
            raise
        except KeyboardInterrupt:  # a signal while loading or caching: nothing trained yet, nothing to save
            name = _script(config, sdxl)
            say(f"{name}: {stops.name} before training started; nothing to save")
            return stops.exit_code


def _leave_process_group() -> None:
    """Several processes, finished: this one's process group torn down before the interpreter's exit tears it down
    (left to the exit, a finished rank aborted there twice in nine runs of the sharded tests on a busy machine,
    "terminate called without an active exception", and the launcher reported the finished run as failed)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _train(config: TrainingConfig, *, sdxl: bool, stops: StopSignals) -> int:
    process = setup_process(config)
    reporter = PhaseReporter(process.paths.events_dir, enabled=process.is_main)
    readers = process.world if config.fsdp else 1  # a sharded run's processes read the files one after another
    reporter.enter("loading", size_bytes=readers * size_on_disk([config.pretrained_model_name_or_path, config.clip_l,
                                                                 config.t5xxl, config.ae, config.network_weights]))
    phases = PhaseTimer(process.device.type, elapsed_before=time.time() - process.started,
                        on_event=reporter.timer_event)
    family = _family_from_headers(config, sdxl)
    data = build_data(config, process, family) if family else None  # kohya's order: a bad dataset is found first
    model = load_model(config, process, sdxl=sdxl)
    if data is None or family is None or family.name != model.family.name:  # a file at its own depth is its family
        data = build_data(config, process, model.family)
    with phases.event("caching"):
        reporter.enter("caching", total=sum(len(d.records) for d in data.all))
        inputs = cache_inputs(config, process, model, data, reporter.advance)
    network = build_network(config, process, model)
    if network.compiled is not None:
        report_compiles(reporter.compiling)
    optimization = build_optimization(config, process, network, data)
    family_objective = build_objective(config, process, model)
    counters = resume(config, process, network, optimization, data)
    objective: Objective = family_objective
    if process.faults is not None:  # tests' injected OOM / NaN: the loop below never looks for them
        objective = process.faults.wrap(family_objective, lambda: counters.global_step, model.vae_scale)
    report = report_run(config, process, data, inputs)
    guard = build_guard(process, network, optimization, counters)
    checkpointer = build_checkpointer(config, process, model, data, inputs, network, optimization, report, guard)
    if config.logging_dir and config.log_with:
        process.accelerator.init_trackers(config.log_prefix or "network_train", config={
            "max_train_steps": optimization.max_train_steps, "train_batch_size": data.spec.batch_size})
    validation = None if data.validation is None else ValidationRun(
        data.validation, config, process.seed, unet=model.bundle.unet, conditioner=inputs.conditioner,
        dtype=process.weight_dtype, accelerator=process.accelerator, objective=objective)
    events_dir = process.paths.events_dir
    recipe = Recipe(config, process, model, data, inputs, network, optimization, objective, report, checkpointer,
                    validation, guard, stops, ControlFile(events_dir / CONTROL_FILE if events_dir else None), phases,
                    CommProfile(process.world, process.device.type, after=TIMING_WARMUP_STEPS))
    stops.in_loop = True  # from here on a signal asks the loop to stop at the next step boundary
    reporter.enter("training")
    # the background sampler of monitor.jsonl reads the step counter by itself: the loop never calls it
    with start_monitor(process.paths.events_dir, config.autotune_monitor_seconds, lambda: counters.global_step,
                       enabled=process.is_main, max_steps=optimization.max_train_steps):
        recipe, loop = run_loop(recipe, counters)
    try:
        if loop.diverged is not None:
            raise Diverged(loop.diverged)
        if loop.oom is not None:
            return finish_oom(recipe, loop, counters)
        if loop.collective is not None:
            return finish_collective(recipe, loop.collective, counters)
        if loop.interrupted:
            return finish_interrupted(recipe, counters)
        return finish_done(recipe, loop, counters)
    except Diverged as diverged:  # also from a save refused for non-finite weights
        return finish_diverged(recipe, diverged.report, counters)


def build_guard(process: Process, network: Network, optimization: Optimization,
                counters: TrainCounters) -> StabilityGuard:
    """The instability checks of this session; a loss scaler (ours or accelerate's) owns non-finite grads."""
    scaled = optimization.loss_scale is not None or getattr(process.accelerator, "scaler", None) is not None
    return StabilityGuard(process.device, network.trainable, local_optimizer(unwrap_optimizer(optimization.optimizer)),
                          scaled=scaled, extra=counters.extra)


def run_loop(r: Recipe, counters: TrainCounters) -> tuple[Recipe, LoopState]:
    """Train to max_train_steps; an OOM, Ctrl-C or instability ends the loop and is recorded in the returned state,
    with the recipe that trained last (the supervisor may change the micro-batch in the process)."""
    from tqdm.auto import tqdm

    config, process = r.config, r.process
    # on stdout: stderr is for messages (the watchdog reports the engine's last stderr line)
    progress = tqdm(total=r.optimization.max_train_steps, initial=counters.global_step, desc="steps",
                    disable=not process.is_main, dynamic_ncols=True, smoothing=0.1, file=sys.stdout)
    now = time.time()
    loop = LoopState(last_report=now, last_state_save=now, session_started=now,
                     largest_bucket=r.data.train.largest_batch())
    r.phases.start_loop()
    if counters.global_step == 0:  # before the first step: the validation baseline, then sample_at_first
        if r.validation is not None:
            with r.phases.event("validation"):
                r.validation.run(0)
        if config.sample_at_first:
            _sample(r, "e000000")  # sd-scripts names the samples before the first step epoch 0
    sampler, loader = _batches(r, counters)
    try:
        _hold_on_card(r)
        while counters.global_step < r.optimization.max_train_steps:
            run_epoch(r, loop, counters, sampler, loader, progress)
            if loop.rebatch is not None:  # the supervisor's micro-batch, from the step boundary it came at
                r = rebatched(r, *loop.rebatch, counters)
                loop.rebatch, loop.largest_bucket = None, r.data.train.largest_batch()
                sampler, loader = _batches(r, counters)
    except KeyboardInterrupt:
        loop.interrupted = True
    except Diverged as diverged:
        loop.diverged = diverged.report
    except Exception as error:  # noqa: BLE001 - only OOMs and failed collectives are handled; the rest re-raises
        collective = collective_failure(error) if process.world > 1 else None
        if collective is not None:
            loop.collective = {"kind": collective, "message": error_summary(error)}
        elif is_oom_error(error):
            loop.oom = {"message": error_summary(error), "type": type(error).__name__}
        else:
            progress.close()  # the error's line then starts a line of its own
            raise
    # Outside the except block: the exception's frames (and the activations they hold) are gone now.
    r.phases.end_loop()
    progress.close()
    return r, loop


def _batches(r: Recipe, counters: TrainCounters) -> tuple[BucketBatchSampler, torch.utils.data.DataLoader]:
    """The sampler and loader of the training data from the counters' position."""
    from sd_scripts_compat.dataset.train_dataset import BucketBatchSampler, make_dataloader

    config, process = r.config, r.process
    sampler = BucketBatchSampler(r.data.train, epoch=counters.epoch, start_step=counters.step_in_epoch,
                                 num_replicas=process.world, rank=process.rank)
    loader = make_dataloader(r.data.train, sampler, num_workers=config.max_data_loader_n_workers or 0,
                             persistent_workers=bool(config.persistent_data_loader_workers),
                             pin_memory=process.device.type == "cuda")
    return sampler, loader


def rebatched(r: Recipe, batch: int, accumulation: int, counters: TrainCounters) -> Recipe:
    """The recipe with another micro-batch and accumulation (the same effective batch), changed in the process:
    the data cut into batches of ``batch`` from the same position, as a restart with them would resume, and
    the settings reported and written with the LoRA changed with it."""
    old = r.data.spec.batch_size
    spec = replace(r.data.spec, batch_size=batch)
    train = replace(r.data.train, spec=replace(r.data.train.spec, batch_size=batch))
    batches = train.num_batches(r.process.world)
    counters.rebatch(old, batch)
    facts = r.checkpointer.facts
    facts.batch_size_per_device, facts.gradient_accumulation_steps = batch, accumulation
    facts.num_batches_per_epoch = batches
    if "batch_size_per_device" in facts.kohya_keys:
        facts.kohya_keys["batch_size_per_device"] = batch
    r.report.settings.update(train_batch_size=batch, gradient_accumulation_steps=accumulation)
    return replace(r, data=replace(r.data, spec=spec, train=train),
                   optimization=replace(r.optimization, accumulation=accumulation, batches_per_epoch=batches),
                   checkpointer=replace(r.checkpointer, micro_batch=batch))


def run_epoch(r: Recipe, loop: LoopState, counters: TrainCounters, sampler: BucketBatchSampler,
              loader: torch.utils.data.DataLoader, progress: tqdm) -> None:
    """The rest of the current epoch: micro-batches, an optimizer step every ``accumulation`` of them."""
    optimization = r.optimization
    sampler.set_epoch(counters.epoch, start_step=counters.step_in_epoch)
    batch_index = counters.step_in_epoch  # micro-batches of this epoch consumed by this process
    for batch in r.phases.batches(loader):  # the wait for each batch is the phase "data"
        r.comm.begin(counters.global_step)  # one step after the warm-up profiled, when several processes run
        with r.on_card():
            micro_step(r, loop, counters, batch, batch_index)
        batch_index += 1
        if batch_index % optimization.accumulation != 0 and batch_index < optimization.batches_per_epoch:
            continue
        with r.on_card():
            optimizer_step(r, counters)
        r.comm.end()
        counters.step_in_epoch = batch_index  # only whole optimizer steps count as consumed
        after_step(r, loop, counters, progress)
        r.phases.step_done()
        if counters.global_step >= optimization.max_train_steps or loop.rebatch is not None:
            return  # the end, or a new micro-batch: run_loop cuts the data again from here
        if batch_index < optimization.batches_per_epoch:
            _stop_if_asked(r)
    end_epoch(r, counters)
    _stop_if_asked(r)  # a stop asked for at an epoch's last step comes after its end (count, saves, samples)


def _hold_on_card(r: Recipe) -> None:
    """What a card holds through the steps, put on the emulated card (when there is one): the denoiser, the text
    encoders and the VAE unless their outputs are cached, the network and the optimizer's state."""
    card, bundle = r.process.card, r.model.bundle
    if card is None:
        return
    encoders = [] if r.inputs.cached_text else list(bundle.text_encoders)
    card.hold([bundle.unet, *encoders, None if r.inputs.cached_latents else bundle.vae, r.network.network],
              optimizer_tensors(local_optimizer(unwrap_optimizer(r.optimization.optimizer))))


def _stop_if_asked(r: Recipe) -> None:
    """SIGINT / SIGTERM came: stop here, at a step boundary (``run_loop`` catches it and the state is saved)."""
    if r.stops is not None and r.stops.agreed(r.process.world):
        raise KeyboardInterrupt


def micro_step(r: Recipe, loop: LoopState, counters: TrainCounters, batch: dict[str, Any], batch_index: int) -> None:
    """Forward and backward of one micro-batch; its loss is added to the running loss on the device."""
    import torch

    from sd_scripts_compat.caching.latent_cache import encode_images, latent_factors
    from sd_scripts_compat.training.train_state import step_generator

    process, objective, unet, phase = r.process, r.objective, r.model.bundle.unet, r.phases.phase
    with phase("to_device"):
        batch = to_device(batch, process.device)
    latents = batch.get("latents")
    if latents is None:
        with torch.no_grad(), phase("vae_encode"):
            seeds = [(process.seed * 1_000_003 + counters.global_step * 4099 + batch_index * 131 + i) % 2**63
                     for i in range(batch["images"].shape[0])]
            vae = r.model.bundle.vae
            latents = encode_images(vae, batch["images"], noise_seeds=seeds, **latent_factors(vae))
    latents = latents.to(process.weight_dtype)
    size = (latents.shape[0], latents.shape[-1] * r.model.vae_scale, latents.shape[-2] * r.model.vae_scale)
    loop.largest_batch = max(loop.largest_batch, (size[0] * size[1] * size[2], *size))  # shapes: no host sync
    generator = step_generator(process.seed, counters.global_step, batch_index * process.world + process.rank,
                               process.device)
    with phase("forward"):
        with process.accelerator.autocast():
            encoder_hidden, added_cond = r.inputs.conditioner.condition(batch, train=r.model.train_text_encoder)
            prediction, state = objective.forward(unet, latents, encoder_hidden, added_cond, generator)
        loss = objective.loss(prediction, state, batch["loss_weights"]).mean()
    with phase("backward"):
        scaled = loss / r.optimization.accumulation
        if r.optimization.loss_scale is not None:
            (scaled * r.optimization.loss_scale.scale).backward()
        else:
            process.accelerator.backward(scaled)
    r.guard.add_loss(loss)


def optimizer_step(r: Recipe, counters: TrainCounters) -> None:
    """Average (several processes), unscale (full_fp16), clip, step, schedule, zero: one optimizer step."""
    with r.phases.phase("optimizer"):
        _optimizer_step(r, counters)


def _optimizer_step(r: Recipe, counters: TrainCounters) -> None:
    import torch

    optimization, trainable, config = r.optimization, r.network.trainable, r.config
    if r.process.world > 1:
        average_gradients(trainable, r.process.world)
    loss_scale = optimization.loss_scale
    do_step = loss_scale.unscale_and_check(trainable) if loss_scale is not None else True
    grad_norm = None
    if config.max_grad_norm and do_step:
        if loss_scale is None:
            grad_norm = r.process.accelerator.clip_grad_norm_(trainable, config.max_grad_norm)
        else:
            torch.nn.utils.clip_grad_norm_(trainable, config.max_grad_norm)
    r.guard.before_optimizer_step(grad_norm)  # with fused AdamW a non-finite step skips itself on the device
    if do_step:
        optimization.optimizer.step()
    optimization.lr_scheduler.step()
    optimization.optimizer.zero_grad(set_to_none=True)
    r.guard.after_optimizer_step(counters.global_step)
    counters.global_step += 1


def after_step(r: Recipe, loop: LoopState, counters: TrainCounters, progress: tqdm) -> None:
    """What follows an optimizer step: progress (the first step, then every ~2 s), validation, saves and samples
    when due."""
    config, step = r.config, counters.global_step
    now = time.time()
    loop.step_ended_at.append(now)
    progress.update(1)
    first_step = len(loop.step_ended_at) == 1  # reported at once: the watchdog and the user see training has begun
    changed = _apply_changes(r, loop)
    if changed or first_step or now - loop.last_report >= PROGRESS_EVERY_SECONDS \
            or step == r.optimization.max_train_steps:
        _report_progress(r, loop, counters, progress, now)
    if r.validation is not None and r.validation.due(step, epoch_end=False):
        with r.phases.event("validation"):
            r.validation.run(step)
    if config.save_every_n_steps and step % config.save_every_n_steps == 0:
        with r.phases.event("save"):
            r.checkpointer.save_intermediate(counters, suffix=f"-step{step:08d}", step=step)
    if config.save_state_every_seconds and _timed_save_due(r, now - loop.last_state_save):
        with r.phases.event("save"):
            r.checkpointer.gather()
            if r.process.is_main:
                r.checkpointer.save_state(r.process.paths.state_dir(), counters)
        loop.last_state_save = now
    if config.sample_every_n_steps and step % config.sample_every_n_steps == 0:
        _sample(r, f"step{step:08d}")


def _timed_save_due(r: Recipe, since_last: float) -> bool:
    """The main process's clock says a timed state save is due; with the optimizer's state sharded every process
    learns it (one all-reduce of a flag per step), as each must send its part."""
    due = since_last >= (r.config.save_state_every_seconds or 0)
    if r.checkpointer.state_sharded:
        return agreed_by_main(due, r.process.world)
    return due and r.process.is_main


def _apply_changes(r: Recipe, loop: LoopState) -> bool:
    """The supervisor's change, if one came (``training.live_changes``), from the next step: gradient checkpointing
    on or off, or the micro-batch (``loop.rebatch``: run_loop cuts the data again); the settings reported and
    written with the LoRA changed with it, and the peak measured afresh. A micro-batch that would change the
    effective batch is not taken."""
    request = r.control.poll()
    if request is None:
        return False
    if "train_batch_size" in request:
        batch, accumulation = int(request["train_batch_size"]), int(request["gradient_accumulation_steps"])
        if batch * accumulation != r.data.spec.batch_size * r.optimization.accumulation:
            return False
        loop.rebatch = (batch, accumulation)
    if any(key in request for key in ("gradient_checkpointing", "cpu_offload_checkpointing")):
        _switch_checkpointing(r, request)
    retries = _read_retry_log(r.config.autotune_retry_log)  # the supervisor recorded the change before asking
    if retries:
        r.checkpointer.facts.extra["ss_autotune_retries"] = json.dumps(retries)
    if r.process.card is not None:
        r.process.card.counter.reset_peak()
    reset_peak(r.process.device)
    loop.peak_memory_mib, loop.control = 0.0, int(request["id"])
    return True


def _switch_checkpointing(r: Recipe, request: dict[str, Any]) -> None:
    on = request.get("gradient_checkpointing", bool(r.report.settings.get("gradient_checkpointing",
                                                                         r.config.gradient_checkpointing)))
    offload = request.get("cpu_offload_checkpointing", bool(r.config.cpu_offload_checkpointing)) and on
    set_checkpointing(r.model.bundle.unet, _learning_encoders(r.model), on=on, offload=offload,
                      transformer=r.model.family.is_transformer)
    r.report.settings.update(gradient_checkpointing=on, cpu_offload_checkpointing=offload)
    r.checkpointer.facts.gradient_checkpointing = on


def end_epoch(r: Recipe, counters: TrainCounters) -> None:
    """The epoch ran to its end: count it, then validation, saves and samples when due."""
    config = r.config
    counters.epoch += 1
    counters.step_in_epoch = 0
    epoch = counters.epoch
    if r.validation is not None and r.validation.due(counters.global_step, epoch_end=True, epoch=epoch):
        with r.phases.event("validation"):
            r.validation.run(counters.global_step)
    if config.save_every_n_epochs and epoch % config.save_every_n_epochs == 0 \
            and counters.global_step < r.optimization.max_train_steps:
        with r.phases.event("save"):
            r.checkpointer.save_intermediate(counters, suffix=f"-{epoch:06d}", step=None)
    if config.sample_every_n_epochs and epoch % config.sample_every_n_epochs == 0:
        _sample(r, f"e{epoch:06d}")


def _report_progress(r: Recipe, loop: LoopState, counters: TrainCounters, progress: tqdm, now: float) -> None:
    """The one host sync of the loop (step losses, gradient norms: judged by the guard, which raises
    :class:`Diverged`), then the bar, the tracker and progress.json."""
    mean_loss = r.guard.report_loss()
    rate = len(loop.step_ended_at) / max(now - loop.session_started, 1e-9)
    loop.peak_memory_mib = max(loop.peak_memory_mib, r.peak_memory_mib())
    loop.resident_memory_mib = r.resident_memory_mib()
    lr_scheduler = r.optimization.lr_scheduler
    unet_lr = lr_scheduler.get_last_lr()[r.optimization.unet_group]  # the UNet's, not a text encoder's
    progress.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{unet_lr:.2e}")
    r.process.accelerator.log({"loss/current": mean_loss, "lr/unet": unet_lr,
                               "speed/it_per_s": rate, "memory/peak_mib": loop.peak_memory_mib,
                               **tensorboard_scalars(r.phases.summary())}, step=counters.global_step)
    events_dir = r.process.paths.events_dir
    if events_dir and r.process.is_main:
        write_event(events_dir, PROGRESS, {
            "step": counters.global_step, "epoch": counters.epoch, "max_train_steps": r.optimization.max_train_steps,
            "time": now, "it_per_s": rate, "loss": mean_loss, "lr": unet_lr,
            "peak_memory_mib": loop.peak_memory_mib, "resident_memory_mib": loop.resident_memory_mib,
            **({"cuda_context_mib": r.process.cuda_context_mib} if r.process.cuda_context_mib is not None else {}),
            "control": loop.control,
            "largest_batch": _batch_size(loop.largest_batch[1:]),
            "largest_bucket": _batch_size(loop.largest_bucket)})
    loop.last_report = now


def _batch_size(size: tuple[int, int, int]) -> dict[str, int]:
    """A micro-batch's size in progress.json: the largest trained so far, the largest the data has (the watchdog
    carries the measured peak from one to the other)."""
    return dict(zip(("micro_batch", "width", "height"), size, strict=True))


def _sample(r: Recipe, name: str) -> None:
    from sd_scripts_compat.training.sampling import sample_during_training

    paths = r.process.paths
    with r.phases.event("sample"):
        sample_during_training(r.model.bundle, r.config, r.process.accelerator, r.process.weight_dtype,
                               r.data.spec.resolution, out_dir=paths.output_dir / "sample",
                               name=f"{paths.output_name}_{name}", conditioner=r.inputs.conditioner)


# ---- 10. The ending: OOM, Ctrl-C, or the final LoRA and summary -----------------------------------------

def finish_oom(r: Recipe, loop: LoopState, counters: TrainCounters) -> int:
    """Free what the failed step held, save the state (when a step was done) and write oom.json."""
    process = r.process
    r.optimization.optimizer.zero_grad(set_to_none=True)
    if r.network.block_swap is not None:
        r.network.block_swap.release_all()  # a step that failed half-way leaves blocks on the device
    gc.collect()
    free_device_memory(process.device)
    state_dir = None  # a sharded optimizer state needs every process, some of which may be mid-step: none saved
    if process.is_main and counters.global_step > 0 and not r.checkpointer.state_sharded:
        state_dir = str(r.checkpointer.save_state(process.paths.state_dir(), counters))
    message = (loop.oom or {}).get("message")
    event = {"step": counters.global_step, "epoch": counters.epoch, "settings": r.report.settings,
             "resolved": r.report.resolved, "memory": {**r.memory_figures(), **_oom_point(message)}, "message": message,
             "state_dir": state_dir}
    if process.paths.events_dir:  # any process's: with several, the one that ran out says so (the rest stop)
        write_event(process.paths.events_dir, OOM, {**event, "rank": process.rank})
    say(f"out of memory at step {counters.global_step}{_of_rank(process)}: {message}")
    return OOM_EXIT_CODE


def _of_rank(process: Process) -> str:
    return f" in process {process.rank} of {process.world}" if process.world > 1 else ""


def finish_collective(r: Recipe, failed: dict[str, str], counters: TrainCounters) -> int:
    """Several processes, a collective failed: another process ended (its own event says why: nothing more is
    written here) or it timed out (comm.json). No state is saved: the others may be mid-step; the last state
    stands."""
    process = r.process
    if failed["kind"] == "timeout" and process.paths.events_dir:
        write_event(process.paths.events_dir, COMM, {"step": counters.global_step, "rank": process.rank,
                                                     "message": failed["message"]})
    what = "another process of the run ended" if failed["kind"] == "peer" else "a collective timed out"
    say(f"stopped at step {counters.global_step}{_of_rank(process)}: {what} ({failed['message']})")
    return COLLECTIVE_EXIT_CODE


def _oom_point(message: str | None) -> dict[str, float]:
    """The CUDA allocator's own account of where it ran out (``oom_point_mib``), when its message gives one."""
    point = oom_point_mib(message)
    return {"oom_point_mib": point} if point is not None else {}


def finish_diverged(r: Recipe, report: dict[str, Any], counters: TrainCounters) -> int:
    """Nothing is saved (the newest state holds the last finite weights); diverged.json says what tripped."""
    process = r.process
    if process.paths.events_dir and process.is_main:
        write_event(process.paths.events_dir, DIVERGED, {
            **report, "epoch": counters.epoch, "max_train_steps": r.optimization.max_train_steps,
            "settings": r.report.settings, "resolved": r.report.resolved})
    say(f"training diverged: {report['reason']} (nothing saved after it; the newest state is the last good one)")
    return DIVERGED_EXIT_CODE


def finish_interrupted(r: Recipe, counters: TrainCounters) -> int:
    """Save the state of the last whole step; exit 130 (SIGINT) or 143 (SIGTERM)."""
    stops = r.stops or StopSignals()
    r.checkpointer.gather()  # every process stopped at the step they agreed on
    if r.process.is_main:
        folder = r.checkpointer.save_state(r.process.paths.state_dir(), counters)
        program = r.model.family.script
        say(f"{program}: {stops.name}: stopped at step {counters.global_step}; state saved to {folder} "
            f"(continue with --resume {folder})")
    return stops.exit_code


def finish_done(r: Recipe, loop: LoopState, counters: TrainCounters) -> int:
    """The final LoRA (and state when asked), done.json and the summary line."""
    config, process = r.config, r.process
    process.accelerator.wait_for_everyone()
    output_file = process.paths.lora_file()
    with r.phases.event("save"):
        if config.save_state or config.save_state_on_train_end:
            r.checkpointer.gather()
        if process.is_main:
            r.checkpointer.save_lora(output_file, counters, final=True)
            if config.save_state or config.save_state_on_train_end:
                r.checkpointer.save_state(process.paths.state_dir(), counters)
    phases = {**r.phases.summary(), "loader_workers": config.max_data_loader_n_workers or 0, "world": process.world}
    process.accelerator.log(tensorboard_scalars(phases), step=counters.global_step)
    peak_memory = max(loop.peak_memory_mib, r.peak_memory_mib())
    ranks, comm = _each_process(process, peak_memory, r.comm.summary())  # a collective: every process is here
    seconds = time.time() - process.started
    # steady state: after the first steps (allocator, caches), and without the steps that compiled a block (their
    # time is torch_compile's seconds); one duration per optimizer step
    ended, compiled = loop.step_ended_at, r.network.compiled
    step_seconds = [b - a for a, b in zip(ended[TIMING_WARMUP_STEPS - 1:], ended[TIMING_WARMUP_STEPS:])
                    if compiled is None or not compiled.compiled_between(a, b)]
    seconds_per_step = sum(step_seconds) / len(step_seconds) if step_seconds else None
    if process.is_main:
        if process.paths.events_dir:
            write_event(process.paths.events_dir, DONE, {
                "output_file": str(output_file), "steps": counters.global_step, "seconds": seconds,
                "seconds_per_step": seconds_per_step, "step_seconds": step_seconds, "peak_memory": peak_memory,
                "resident_memory": loop.resident_memory_mib,
                "memory": r.memory_figures(),  # CUDA max allocated / reserved, peak RSS, the emulated card's
                "validation_loss": r.validation.history if r.validation is not None else [],
                "settings": r.report.settings, "resolved": r.report.resolved, "phases": phases,
                "family": r.model.family.name, "torch_compile": compile_summary(r.network.compiled),
                "channels_last": r.network.channels_last, "process_peaks": ranks, "communication": comm})
        print(f"done: {counters.global_step} steps in {seconds:.1f} s, peak memory {peak_memory:.0f} MiB, "
              f"LoRA written to {output_file}")
    process.accelerator.end_training()
    return 0


# ---- helpers: small, explicit, no state of their own ------------------------------------------------

def _each_process(process: Process, peak_mib: float,
                  comm: dict[str, Any] | None) -> tuple[list[float], list[dict[str, Any] | None] | None]:
    """Every process's peak memory (MiB) and its profiled collectives (``training.comm_profile``), in rank order:
    one gather at the end of several processes' run (with ``fsdp`` each holds its own share of the model); this
    process's peak alone and no collectives otherwise."""
    if process.world < 2:
        return [peak_mib], None
    import torch.distributed as dist

    each: list[Any] = [None] * process.world
    dist.all_gather_object(each, (peak_mib, comm))
    return [float(peak) for peak, _ in each], [profiled for _, profiled in each]


def cache_dir(process: Process) -> Path:
    """Where disk caches of images in a folder we may not write to go (a read-only dataset): the run's output."""
    return process.paths.output_dir / ".cache"


def _captions_fixed(datasets: list[TrainDataset]) -> bool:
    """True when no caption option (shuffle, dropout, warm-up) changes a processed caption between steps."""
    from sd_scripts_compat.dataset.captions import caption_is_deterministic

    return all(caption_is_deterministic(subset) is None for dataset in datasets for subset in dataset.subsets)


def _script(config: TrainingConfig, sdxl: bool) -> str:
    """The entry point this run was started as (``kohya_args.SCRIPTS``)."""
    return getattr(config, "script", None) or ("sdxl_train_network" if sdxl else "train_network")


def _family_from_headers(config: TrainingConfig, sdxl: bool) -> FamilySpec | None:
    """The model's family from its headers or configs alone (a built-in, a folder, a .safetensors file), so the
    datasets are read before the weights, as sd-scripts does; None when only loading can tell (the loader then
    says what is wrong, in its words)."""
    from sd_scripts_compat.models.build import check_trainable
    from sd_scripts_compat.models.detect import BUILTIN_PREFIX, ENGINE_STATED_BY, detect_family

    model = str(config.pretrained_model_name_or_path or "")
    path = Path(model).expanduser()
    if not (model.startswith(BUILTIN_PREFIX) or path.is_dir() or path.suffix.lower() == ".safetensors"):
        return None
    try:
        family = detect_family(model, _stated_family(config, sdxl), stated_by=ENGINE_STATED_BY)
    except UserError:
        return None
    check_trainable(family, builtin=model.startswith(BUILTIN_PREFIX))  # what we cannot train is said first
    return family


def _stated_family(config: TrainingConfig, sdxl: bool) -> FamilySpec | None:
    """The family the user's flags state (kohya has no family flag: sdxl entry point, v2, v_parameterization)."""
    from sd_scripts_compat.models.detect import family_for_kohya_flags

    if _script(config, sdxl) != "train_network":
        return None  # detected from the file; load_model checks the entry point trains its family
    return family_for_kohya_flags(bool(config.v2), bool(config.v_parameterization))


def _enable_xformers(unet: ModelMixin) -> None:
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


def _read_retry_log(path: str | None) -> list[dict[str, Any]]:
    if not path:
        return []
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise UserError(f"{path}: cannot read the retry log ({error})") from None
