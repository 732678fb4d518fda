"""A run's plan written into its folder: ``autotune plan``'s request builder and planner, the model files it names
checked, then config.toml + dataset.toml (+ musubi's files) and autotune_plan.json. Shared by our engine's and
musubi-tuner's runs (``launch.run``, ``launch.musubi_run``), which otherwise do not import each other."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from sd_scripts_compat.facts.errors import UserError

if TYPE_CHECKING:
    from autotune.planning.planner import Plan
    from sd_scripts_compat.facts.families import FamilySpec


def plan_into(args: argparse.Namespace, out: Path, family: FamilySpec | None = None, *,
              one_card: bool = False) -> tuple[Path, Path, Plan]:
    """Plan with `autotune plan`'s own request builder (``family``: the run's detected ``FamilySpec``); write
    config.toml + dataset.toml into ``out``. Returns both paths and the plan. ``one_card``: the engine trains in
    one process (the user's sd-scripts / musubi-tuner under the watchdog), so the plan is for the first card: one
    over several (its effective batch, sharding, DeepSpeed) would not be what trains."""
    from autotune.launch.plan_options import build_request, render
    from autotune.planning.planner import plan_training
    from autotune.planning.toml_writer import write_plan_files

    args.out = str(out)
    request = build_request(args, family)
    if one_card:
        request = replace(request, gpus=request.gpus[:1])
    plan = plan_training(request)
    if not plan.fits:
        raise UserError(f"{args.model}: {plan.message}")
    check_model_files(plan)
    render(plan)
    config, dataset = write_plan_files(plan, out, args.format)  # with autotune_plan.json, for the report
    return config, dataset, plan


def check_model_files(plan: Plan) -> None:
    """Every separate model file the plan names exists (a placeholder left by the planner is named with its
    option), before anything is written."""
    from autotune.planning.profiles import model_file_keys

    keys = set(model_file_keys())
    for choice in plan.choices:
        if choice.key in keys and not Path(str(choice.value)).expanduser().is_file():
            raise UserError(f"{plan.model} needs its {choice.key} file ({choice.reason}); give it with "
                            f"--{choice.key} FILE")
