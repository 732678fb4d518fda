"""``autotune run DATASET --model DIT --engine musubi-tuner=PATH``: the watchdog's job for the user's musubi-tuner.

The plan is written as ``autotune plan --out`` writes it (musubi's dataset.toml, config.toml and musubi_train.sh in
the run folder); the engine (``autotune.recovery.musubi``) caches and trains from there. ``--config`` is not taken
for these families: the run folder's files are musubi's own, not a kohya config.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.layout import RUN_STATE
from sd_scripts_compat.facts.errors import UserError

if TYPE_CHECKING:
    from autotune.hardware.probe import SystemProbe
    from autotune.planning.planner import Plan
    from autotune.recovery.watchdog import Job
    from sd_scripts_compat.facts.dataset_scan import DatasetScan
    from sd_scripts_compat.facts.families import FamilySpec


def early_check(args: argparse.Namespace) -> None:
    """The cheap refusals before the dataset check and the plan: --config, a built-in model, a PATH that is not a
    musubi-tuner with this family's script, a --python that is not a program."""
    from autotune.recovery.musubi import find_install, parse_engine
    from sd_scripts_compat.models.detect import BUILTIN_PREFIX, detect_family

    if getattr(args, "config", None):
        raise UserError("--config with --engine musubi-tuner: autotune run plans musubi's files itself; drop "
                        "--config (or run your own files with musubi-tuner directly)")
    if str(args.model).startswith(BUILTIN_PREFIX):
        raise UserError(f"--model {args.model}: musubi-tuner loads the model's own DiT file; give it (e.g. "
                        "qwen_image_bf16.safetensors) with --model")
    root = parse_engine(args.engine)
    if root is None:
        raise UserError(f"--engine {args.engine}: expected musubi-tuner=PATH (your musubi-tuner checkout)")
    find_install(root, args.python, detect_family(args.model, args.family))


def musubi_job(args: argparse.Namespace, out: Path, scan: DatasetScan, probe: SystemProbe, started: dict[str, Any],
               family: FamilySpec) -> Job:
    """Plan into ``out`` (or read the interrupted run back), then the job the watchdog runs with musubi-tuner."""
    from autotune.launch.kohya_job import images_per_s_model, pinned_fields
    from autotune.planning.musubi_writer import musubi_commands
    from autotune.recovery.attempt import address_space_limit, read_json
    from autotune.recovery.ladder import LadderLimits, memory_predictor
    from autotune.recovery.musubi import MusubiEngine, find_install, parse_engine
    from autotune.recovery.watchdog import Job
    from sd_scripts_compat.facts.kohya_toml import flat_values, read_toml
    from sd_scripts_compat.facts.settings import TrainSettings

    cuda = probe.accelerator == "cuda"
    saved = (read_json(out / RUN_STATE) or {}) if args.resume else {}
    if args.resume and not isinstance(saved.get("musubi_commands"), list):
        raise UserError(f"{out}: not a musubi-tuner run (it was not started with --engine musubi-tuner=PATH); "
                        "resume it with the engine it started with")
    if args.resume:
        base = TrainSettings.from_event(saved["musubi_base"])
        settings = TrainSettings.from_event(saved.get("settings") or saved["musubi_base"])
        models, budget, planned = saved["musubi_models"], saved["usable_mib"], saved.get("planned_it_per_s")
        commands = tuple(tuple(command) for command in saved["musubi_commands"])
    else:
        plan = _plan(args, out, family)
        assert plan.settings is not None and plan.prediction is not None, "plan_into refuses a plan that does not fit"
        base = settings = plan.settings
        budget, planned = plan.prediction.usable_bytes / 2**20, plan.prediction.it_per_s
        commands = musubi_commands(plan)  # musubi_train.sh's, so a run trains exactly what the plan wrote
        models = _model_files(plan, commands, args.model)
    install = find_install(parse_engine(args.engine) or Path(), args.python, family)
    print(install.describe())
    env = install.env({**os.environ, "HF_HUB_OFFLINE": "1"})
    name = str(flat_values(read_toml(out / "config.toml")).get("output_name") or "lora")
    engine = MusubiEngine(install, family, out, base, models, commands, name, args.save_state_every, env, planned)
    gpu = next((g for g in probe.gpus if g.backend == "cuda"), None) if cuda else None
    limits = LadderLimits.for_family(family, budget, fp8_supported=bool(gpu and gpu.fp8) or base.fp8_base,
                                     te_cache_allowed=False)
    if args.memory_limit:  # an address-space budget (a machine without the card the plan is for: tests)
        limits = replace(limits, budget_mib=float(args.memory_limit))
    return Job(config_path=out / "config.toml", output_dir=out, settings=settings, limits=limits,
               predict=memory_predictor(family, cuda=True), dataset_config_path=out / "dataset.toml", env=env,
               cuda=cuda, max_retries=args.max_retries, stall_timeout_s=args.stall_timeout,
               resume=bool(args.resume), prior_retries=list(saved.get("retries") or []), train_output_dir=out,
               states_at=out, engine=engine, budget_kind="address_space" if args.memory_limit else "device",
               preexec_fn=address_space_limit(args.memory_limit) if args.memory_limit else None,
               images_per_s=None if args.no_step_up else images_per_s_model(family, probe, cuda),
               fixed=pinned_fields(args), sample_gpu=cuda,
               extra_state={**started, "usable_mib": budget, "musubi_base": base.to_event(), "musubi_models": models,
                            "musubi_commands": [list(command) for command in commands], "planned_it_per_s": planned})


def _plan(args: argparse.Namespace, out: Path, family: FamilySpec) -> Plan:
    """The plan, with musubi's files written into ``out`` as ``autotune run`` writes any plan's: for one card,
    as musubi-tuner trains in one process under the watchdog."""
    from autotune.launch.plan_into import plan_into

    return plan_into(args, out, family, one_card=True)[2]


def _model_files(plan: Plan, commands: tuple[tuple[str, ...], ...], dit: str) -> dict[str, str]:
    """The model files the commands' variables stand for (``$DIT``: ``--model``; ``$VAE``, ``$TEXT_ENCODER``,
    ``$T5``: the plan's files), as absolute paths."""
    values = {"dit": dit, **plan.kohya_values()}
    names = {word[1:].lower() for command in commands for word in command if word.startswith("$")}
    return {name: str(Path(str(values[name])).expanduser().resolve()) for name in sorted(names) if values.get(name)}
