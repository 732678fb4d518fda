"""The watchdog's job for an engine that reads kohya configs (ours, the user's sd-scripts): the configs planned or
copied into the run folder, resolved as the engine will read them, the memory ladder's limits and predictor, and
the engine itself. ``autotune run`` reaches it through the engine registry (``launch.engines``)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.estimate.memory_view import MemoryView
from autotune.layout import CONFIG, DATASET_CONFIG, RUN_STATE, STATE_DIR
from autotune.recovery.attempt import address_space_limit
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.quiet import VERBOSE_ENV

if TYPE_CHECKING:
    from autotune.hardware.probe import SystemProbe
    from autotune.planning.planner import Plan
    from autotune.recovery.engine import Engine
    from autotune.recovery.ladder import LadderLimits
    from autotune.recovery.stability import StabilityLimits
    from autotune.recovery.watchdog import Job
    from sd_scripts_compat.config.resolved_run import ResolvedRun
    from sd_scripts_compat.facts.dataset_scan import DatasetScan
    from sd_scripts_compat.facts.families import FamilySpec
    from sd_scripts_compat.facts.settings import TrainSettings

    # make_engine(family, config, train_output, plan): the engine, and where its states are looked for
    MakeEngine = Callable[[FamilySpec, Path, Path, Plan | None], tuple[Engine, Path | None]]


def ours_job(args: argparse.Namespace, out: Path, scan: DatasetScan, probe: SystemProbe, started: dict[str, Any],
             family: FamilySpec) -> Job:
    """The watchdog's job for our engine: its state folders under ``out``."""
    from autotune.recovery.engine import CompatEngine

    def engine(family: FamilySpec, config_path: Path, train_output: Path,
               plan: Plan | None) -> tuple[Engine, Path | None]:
        return CompatEngine.for_module(family.engine_module, save_state_every_s=args.save_state_every,
                                       processes=_processes(plan, probe)), out / STATE_DIR

    return kohya_job(args, out, scan, probe, started, family, engine)


def _processes(plan: Plan | None, probe: SystemProbe) -> int:
    """One process per GPU the plan spread the run over, where this machine has that many (a plan for another
    machine's cards trains here on one)."""
    planned = next((int(c.value) for c in plan.choices if c.key == "num_processes"), 1) if plan else 1
    here = len(probe.gpus) if probe.accelerator == "cuda" else 1
    return planned if planned <= here else 1


def sd_scripts_job(args: argparse.Namespace, out: Path, scan: DatasetScan, probe: SystemProbe, started: dict[str, Any],
                   family: FamilySpec) -> Job:
    """The watchdog's job for the user's sd-scripts: its states beside the LoRA (it has no option for another
    folder)."""
    from autotune.recovery.sd_scripts import prepare

    def engine(family: FamilySpec, config_path: Path, train_output: Path,
               plan: Plan | None) -> tuple[Engine, Path | None]:
        return prepare(args.engine, args.python, family=family, config=config_path, output_dir=out,
                       states_dir=train_output, save_every_s=args.save_state_every, env=os.environ,
                       planned_it_per_s=plan.prediction.it_per_s if plan and plan.prediction else None), None

    return kohya_job(args, out, scan, probe, started, family, engine, one_process=True)


def kohya_job(args: argparse.Namespace, out: Path, scan: DatasetScan, probe: SystemProbe, started: dict[str, Any],
              model_family: FamilySpec, make_engine: MakeEngine, *, one_process: bool = False) -> Job:
    """The watchdog's job for an engine that reads kohya configs: configs planned or copied into ``out``;
    ``make_engine(family, config, train_output, plan)`` gives the engine and where its states are looked for;
    ``one_process``: the engine trains in one process (the user's sd-scripts), so it is planned for one card."""
    from autotune.launch.plan_options import emulated_card_mib, memory_model_scale
    from autotune.recovery.attempt import read_json
    from autotune.recovery.watchdog import Job
    from sd_scripts_compat.training.emulated_card import CARD_ENV

    cuda = probe.accelerator == "cuda"
    card = emulated_card_mib(args)
    config_path, dataset_path, plan = _configs(args, out, scan, model_family, one_process)
    usable_mib = _usable_mib(plan)
    family, resolved = _resolve(config_path, dataset_path, args, model_family)
    settings = resolved.settings
    prior: list[dict[str, Any]] = []
    if args.resume:
        saved = read_json(out / RUN_STATE) or {}
        usable_mib = saved.get("usable_mib")
        if isinstance(saved.get("settings"), dict):
            settings = _saved_settings(saved["settings"], out)
        prior = list(saved.get("retries") or [])
    train_output = Path(resolved.config.output_dir or out)
    engine, states_at = make_engine(family, config_path, train_output, plan)
    processes = _sharding_processes(engine, family)
    limits = replace(_limits(probe, family, resolved, args, cuda, usable_mib, card), shard_processes=processes)
    job = Job(
        config_path=config_path, output_dir=out, settings=settings, limits=limits,
        predict=_predictor(family, resolved, cuda, MemoryView(emulated=card is not None,
                                                              scale=memory_model_scale(args)), processes),
        dataset_config_path=dataset_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **({VERBOSE_ENV: "1"} if getattr(args, "verbose", False) else {}),
             **({CARD_ENV: f"{card:g}"} if card is not None else {})},
        cuda=cuda, max_retries=args.max_retries,
        stall_timeout_s=args.stall_timeout, resume=bool(args.resume),
        preexec_fn=address_space_limit(args.memory_limit) if args.memory_limit else None, prior_retries=prior,
        train_output_dir=train_output, states_at=states_at, extra_state={"usable_mib": limits.budget_mib, **started},
        budget_kind=_budget_kind(args, cuda, card),
        engine=engine,
        stability=_stability_limits(probe, cuda),
        images_per_s=images_per_s_model(family, probe, cuda) if not getattr(args, "no_step_up", False) else None,
        fixed=pinned_fields(args), sample_gpu=cuda,
    )
    return job


def _configs(args: argparse.Namespace, out: Path, scan: DatasetScan, family: FamilySpec,
             one_process: bool) -> tuple[Path, Path | None, Plan | None]:
    """config.toml (+ dataset.toml) in ``out``: planned, copied from ``--config``, or kept from the run
    being resumed. Returns their paths and the plan, when there is one (its predictions go on to the watchdog:
    the step-down budget, a wrapped trainer's first save interval)."""
    config_path, dataset_path = out / CONFIG, out / DATASET_CONFIG
    if args.resume:
        return config_path, dataset_path if dataset_path.is_file() else None, None
    if not args.config:
        from autotune.launch.plan_into import plan_into

        return plan_into(args, out, family, one_card=one_process)
    return config_path, _copy_user_configs(args, out, scan), None


def _copy_user_configs(args: argparse.Namespace, out: Path, scan: DatasetScan) -> Path | None:
    """Copy ``--config`` (and ``--dataset-config``) into ``out`` with the model and the data set.

    The config's own ``output_dir`` is honoured; without one, LoRA files go to ``out`` and the user is told
    so. Returns the dataset config's path in ``out`` (None: the folder convention, which
    needs N_name subfolders: sd-scripts' ``train_data_dir`` does not read images directly in the folder).
    """
    from sd_scripts_compat.facts.kohya_toml import flat_values, read_toml, set_config_values, write_toml

    dataset_dir = scan.root
    user = Path(args.config)
    document = read_toml(user)
    forced: dict[str, Any] = {"pretrained_model_name_or_path": args.model}
    if args.allow_pickle:
        forced["allow_pickle"] = True
    given_output = flat_values(document).get("output_dir")
    if given_output:
        print(f"LoRA files go to {Path(given_output).resolve()} (output_dir of {user})")
    else:
        forced["output_dir"] = str(out)
        print(f"{user} sets no output_dir: LoRA files go to {out}")
    dataset_path: Path | None = None
    if args.dataset_config:
        dataset_path = out / DATASET_CONFIG
        write_toml(dataset_path, read_toml(args.dataset_config, "dataset config"),
                   f"# from {args.dataset_config} (autotune run)\n")
        forced["dataset_config"] = str(dataset_path)
    else:
        forced["train_data_dir"] = str(dataset_dir)
    write_toml(out / CONFIG, set_config_values(document, forced), f"# from {user} (autotune run)\n")
    return dataset_path


def _resolve(config_path: Path, dataset_path: Path | None, args: argparse.Namespace,
             model_family: FamilySpec) -> tuple[FamilySpec, ResolvedRun]:
    """The family and the run as the engine will resolve it (its own reader, kohya's precedence), refused now if
    the family's own rules refuse it (a swap count over its maximum), before anything loads."""
    from sd_scripts_compat.config.resolved_run import settings_from_files
    from sd_scripts_compat.facts.kohya_toml import flat_values, read_toml
    from sd_scripts_compat.models.detect import detect_family
    from sd_scripts_compat.training.block_swap import check_blocks_to_swap

    model = str(flat_values(read_toml(config_path)).get("pretrained_model_name_or_path") or args.model)
    # the run's family, unless a --config trains another model than --model names
    family = model_family if model == str(args.model) else detect_family(model, getattr(args, "family", None))
    resolved = settings_from_files(config_path, dataset_path, script=family.script,
                                   default_resolution=(family.resolution, family.resolution))
    check_blocks_to_swap(family, resolved.settings.blocks_to_swap)
    return family, resolved


def _saved_settings(values: dict[str, Any], out: Path) -> TrainSettings:
    from sd_scripts_compat.facts.settings import TrainSettings

    try:
        return TrainSettings.from_event(values)
    except (ValueError, TypeError) as error:
        raise UserError(f"{out}: the saved run state is from another version ({error}); "
                        "start a new run with another --out") from None


def _limits(probe: SystemProbe, family: FamilySpec, resolved: ResolvedRun, args: argparse.Namespace, cuda: bool,
            usable_mib: float | None, card: float | None = None) -> LadderLimits:
    """What the ladder may do on this machine, and the memory it must fit in (MiB).

    The budget is the emulated card (``card``, MiB), or the plan's usable VRAM when there is a plan, else the
    probed card's, else (CPU) the address-space cap or the available RAM.
    """
    from autotune.recovery.ladder import LadderLimits

    gpu = next((g for g in probe.gpus if g.backend == "cuda"), None) if cuda else None
    if card is not None:
        budget = card
    elif args.memory_limit:
        budget = args.memory_limit
    elif usable_mib:
        budget = usable_mib
    elif args.vram:
        budget = min(args.vram) * 1024
    elif gpu is not None and gpu.vram_total_bytes:
        budget = (gpu.vram_total_bytes - max(gpu.vram_used_bytes or 0, gpu.other_processes_vram_bytes or 0)) / 2**20
    else:
        budget = probe.memory.ram_available_bytes / 2**20
    # the rung would change nothing when the engine already caches the frozen text encoder's outputs
    te_cache_allowed = not _captions_randomized(resolved) and not _engine_caches_text(resolved)
    return LadderLimits.for_family(family, budget, fp8_supported=bool(gpu and gpu.fp8),
                                   te_cache_allowed=te_cache_allowed)


def _budget_kind(args: argparse.Namespace, cuda: bool, card: float | None) -> str:
    """What the step-down budget measures (``watchdog.measured_mib``)."""
    if card is not None:
        return "emulated_card"
    return "address_space" if args.memory_limit else ("device" if cuda else "ram")


def _stability_limits(probe: SystemProbe, cuda: bool) -> StabilityLimits:
    """The stability ladder may move fp16 to bf16 only on a card that computes in bf16."""
    from autotune.recovery.stability import StabilityLimits

    gpu = next((g for g in probe.gpus if g.backend == "cuda"), None) if cuda else None
    return StabilityLimits(bf16_supported=bool(gpu and gpu.bf16))


def _captions_randomized(resolved: ResolvedRun) -> bool:
    """A caption option (shuffle, dropout, warm-up) on any subset, wherever the dataset.toml set it."""
    from sd_scripts_compat.dataset.captions import caption_is_deterministic

    return any(caption_is_deterministic(subset) is not None for subset in resolved.dataset.subsets)


def _engine_caches_text(resolved: ResolvedRun) -> bool:
    """Our engine encodes fixed captions once when no text-encoder LoRA trains (UNet-only)."""
    return bool(resolved.config.network_train_unet_only) and not _captions_randomized(resolved)


def pinned_fields(args: argparse.Namespace) -> frozenset[str]:
    """The settings a step up leaves as the user gave them: ``--batch`` / ``--accum`` pin the micro-batch split."""
    split = getattr(args, "batch", None) is not None or getattr(args, "accum", None) is not None
    return frozenset({"train_batch_size", "gradient_accumulation_steps"} if split else ())


def images_per_s_model(family: FamilySpec, probe: SystemProbe, cuda: bool) -> Callable[[TrainSettings], float]:
    """The speed model's images per second on this machine's first card (or its CPU), for the step-up check (every
    engine steps up; ``--no-step-up`` keeps the plan's settings)."""
    from autotune.launch.plan_options import targets_from_probe
    from autotune.planning.search import estimate_for_settings

    gpus, cores, _, _ = targets_from_probe(probe)
    spec = gpus[0].spec if cuda and gpus else None

    def rate(settings: TrainSettings) -> float:
        speed = estimate_for_settings(family, settings, cores, on_gpu=cuda)[1](spec)
        return float(speed.it_per_s) * settings.train_batch_size

    return rate


def _predictor(family: FamilySpec, resolved: ResolvedRun, cuda: bool,
               memory: MemoryView, processes: int = 1) -> Callable[[TrainSettings], float]:
    from autotune.recovery.ladder import memory_predictor

    return memory_predictor(family, text_encoder_outputs_cached=_engine_caches_text(resolved), cuda=cuda,
                            memory=memory, processes=processes)


def _sharding_processes(engine: Engine, family: FamilySpec) -> int:
    """The processes the ladder may shard the denoiser across: our engine's, for the families planned sharded
    (planning.sharding); 1 otherwise."""
    from autotune.planning.sharding import can_shard
    from autotune.recovery.engine import CompatEngine

    processes = engine.processes if isinstance(engine, CompatEngine) else 1
    return processes if can_shard(family, processes) else 1


def _usable_mib(plan: Plan | None) -> float | None:
    """A GPU plan's usable VRAM is the step-down budget; a CPU plan (fp32 or bf16) leaves it to the probed RAM."""
    if plan is None or not plan.prediction or not plan.settings or plan.device == "CPU":
        return None
    return plan.prediction.usable_bytes / 2**20
