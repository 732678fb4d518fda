"""Host RAM in the plan: predict the peak beside VRAM, step the data loader down when it would not fit, warn
when even that is not enough (``autotune.estimate.ram_model`` says what each part is).

The planner caches latents to disk already (``cache_latents_to_disk``), so the one thing left to give up for
host RAM is data loader workers (each a process with its own private pages and prefetched batches), halved
down to 0. Model loading is usually the peak (the weights in their training dtype): no setting of the plan lowers
it, so then the plan says so and how much the machine lacks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autotune.estimate.ram_model import (
    GIB,
    PROCESS_BYTES,
    WORKER_PRIVATE_BYTES,
    RamEstimate,
    RamInputs,
    model_file_bytes,
    predict_ram,
    sharded_turn_bytes,
)
from autotune.planning.request import PlanRequest
from sd_scripts_compat.facts.families import FamilySpec
from sd_scripts_compat.facts.settings import TrainSettings

OS_RESERVE_BYTES = 2 * GIB  # --ram GB is the machine's total: the OS, a desktop and the page cache keep this much


@dataclass(frozen=True)
class HostRamPlan:
    workers: int  # max_data_loader_n_workers after any step-down
    estimate: RamEstimate
    usable_bytes: int | None  # RAM the run may use (None: unknown, nothing checked)
    fallbacks: tuple[str, ...]
    warnings: tuple[str, ...]


def default_workers(request: PlanRequest) -> int:
    """Pinned ``--workers``; else none when training on the CPU (the step's threads use every core, and a batch of
    cached latents loads in the main process: ~1.5 ms of a 0.8 s step, tiny-sd15 at batch 4 on 2 cores); else
    min(2, physical cores // 2): cached latents make a batch cheap to load."""
    if request.preferences.workers is not None:
        return request.preferences.workers
    return min(2, request.cpu_physical_cores // 2) if request.gpus else 0


def plan_host_ram(request: PlanRequest, family: FamilySpec, settings: TrainSettings, num_images: int,
                  tensor_peak_bytes: int, *, modelled: tuple[int, int] | None = None,
                  own_model: bool = False, processes: int = 1) -> HostRamPlan:
    """The workers the machine's RAM allows and the predicted peak; ``tensor_peak_bytes`` counts for CPU plans.
    ``modelled`` is (loading, training) host RAM from a family's own memory model (FLUX: swapped blocks and
    parked encoders), used instead of the UNet families' RAM model. ``processes`` (one per GPU) each load the
    model and hold their own host memory, at the same time, except a sharded denoiser: read one process at a time,
    each sharding it before the next reads (``RamEstimate.turn_bytes``)."""
    usable = request.host_ram_bytes
    on_gpu = bool(request.gpus)
    workers = default_workers(request)

    def estimate(n: int) -> RamEstimate:
        one = one_process(n)
        turn = sharded_turn_bytes(family, one.inputs, settings.shard_ranks(processes), settings.fsdp_offload_params) \
            if settings.fsdp and processes > 1 and on_gpu else 0  # sharded runs load in turn
        return replace(one, processes=processes, turn_bytes=turn)

    def one_process(n: int) -> RamEstimate:
        inputs = RamInputs(
            family=family.name, resolution=settings.resolution[0], batch_size=settings.train_batch_size,
            num_images=num_images, num_workers=n, weight_dtype=settings.weight_dtype,
            cache_latents=settings.cache_latents, cache_latents_to_disk=True,
            cache_text_encoder_outputs=settings.cache_text_encoder_outputs,
            model_file_bytes=model_file_bytes(request.model), on_gpu=on_gpu,
            training_tensor_bytes=0 if on_gpu else tensor_peak_bytes)
        if modelled is not None:
            loading, training = modelled
            return RamEstimate(inputs=inputs, components={"process": 0, "loading": loading, "training": training},
                               loading_bytes=loading, training_bytes=training)
        if own_model:  # a DiT family on the CPU: its weights are part of the tensors, all of them in RAM
            workers = n * WORKER_PRIVATE_BYTES
            return RamEstimate(inputs=inputs, components={"process": PROCESS_BYTES, "training_tensors":
                                                          tensor_peak_bytes, "dataloader_workers": workers},
                               loading_bytes=tensor_peak_bytes, training_bytes=tensor_peak_bytes + workers)
        return predict_ram(inputs)

    current = estimate(workers)
    fallbacks: list[str] = []
    def training_peak(e: RamEstimate) -> int:  # fewer workers lower the training phase only, never the loading
        return e.processes * (e.components["process"] + e.training_bytes)

    if usable is not None and training_peak(current) > usable and workers > 0 and modelled is None:
        start = workers
        while workers > 0 and training_peak(estimate(workers)) > usable:
            workers //= 2
        current = estimate(workers)
        fallbacks.append(f"host RAM: data loader workers {start} -> {workers}")
    warnings: list[str] = []
    if usable is not None and current.peak_bytes > usable:
        loading = current.loading_sets_peak
        phase = "model loading (the model's weights, read into their training dtype)" if loading else "training"
        if processes > 1:
            phase += f", {processes} processes (one per GPU)" + (
                " in turn, each keeping its text encoders" if loading and current.turn_bytes else " at once")
        warnings.append(f"host RAM is the limit: predicted peak {current.peak_gib:.1f} GiB during {phase}, "
                        f"{usable / GIB:.1f} GiB usable; close other programs, add swap, or use a machine with "
                        f"at least {-(-(current.peak_bytes + OS_RESERVE_BYTES) // GIB)} GB RAM")
    return HostRamPlan(workers=workers, estimate=current, usable_bytes=usable, fallbacks=tuple(fallbacks),
                       warnings=tuple(warnings))
