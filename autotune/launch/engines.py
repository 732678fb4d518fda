"""The engines ``autotune run`` trains with, registered by name: ours, the user's sd-scripts, the user's
musubi-tuner, and any an installed package registers under the entry-point group ``lora_autotune.engines`` (its
value: a module attribute holding an :class:`EngineKind`).

``--engine NAME=PATH`` on the CLI, the wizard's offer and the web app's engine list read this registry; the
kinds' hooks (``check``, ``job``, ``offer``) are where each engine's own modules are reached, so no other module
chooses by an engine's name. Entry points, not a table here: a trainer we do not ship is one package away.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sd_scripts_compat.facts.errors import UserError

if TYPE_CHECKING:
    from autotune.recovery.watchdog import Job
    from sd_scripts_compat.facts.families import FamilySpec

ENTRY_POINT_GROUP = "lora_autotune.engines"
OURS = "autotune"  # our engine's name on the web page and in a run's record (no --engine)


@dataclass(frozen=True)
class EngineKind:
    """One engine: its name, whose families it trains, and its hooks (each a deferred import of its own code)."""

    name: str  # what --engine NAME=PATH names
    checkout: str  # what PATH is, in words ("your sd-scripts checkout or lora-scripts folder")
    trainer: str | None  # ``FamilySpec.trainer`` of the families it trains; None: the families our engine trains
    check: Callable[[argparse.Namespace], None]  # cheap refusals before planning (PATH, its Python, the model)
    # the watchdog's job for a run: (args, run folder, dataset scan, probe, what to keep, the model's FamilySpec)
    job: Callable[[argparse.Namespace, Path, Any, Any, dict[str, Any], FamilySpec], Job]
    offer: Callable[[Path, str | None], list[str]] | None = None  # ``autotune ui --engine``: checked run options
    # ``autotune train CONFIG --engine``: run the user's kohya config in the foreground, no watchdog (its exit code)
    train_config: Callable[..., int] | None = None
    own_measurements: bool = False  # its speed and memory go into the measurement store (ours alone)

    def trains(self, family: FamilySpec) -> bool:
        return family.trained_here if self.trainer is None else family.trainer == self.trainer

    @property
    def option(self) -> str:
        """How a command names it (nothing for ours)."""
        return "" if self.trainer is None else f"--engine {self.name}=PATH"


def _nothing_to_check(args: argparse.Namespace) -> None:
    """Our engine runs in this Python from this package: nothing to find."""


def _ours() -> EngineKind:
    from autotune.launch import kohya_job

    return EngineKind(name=OURS, checkout="", trainer=None, check=_nothing_to_check, job=kohya_job.ours_job,
                      own_measurements=True)


def _sd_scripts() -> EngineKind:
    from autotune.launch import kohya_job
    from autotune.recovery import sd_scripts

    return EngineKind(name=sd_scripts.ENGINE_NAME, checkout="your sd-scripts checkout or lora-scripts folder",
                      trainer="sd-scripts", check=sd_scripts.check, job=kohya_job.sd_scripts_job,
                      offer=sd_scripts.offer, train_config=sd_scripts.train_config)


def _musubi() -> EngineKind:
    from autotune.launch import musubi_run
    from autotune.recovery import musubi

    return EngineKind(name=musubi.ENGINE_NAME, checkout="your musubi-tuner checkout", trainer="musubi-tuner",
                      check=musubi_run.early_check, job=musubi_run.musubi_job, offer=musubi.offer)


def registered_engines() -> dict[str, EngineKind]:
    """Every engine by name: ours and the two we ship first, then those installed packages register."""
    from importlib.metadata import entry_points

    kinds = {kind.name: kind for kind in (_ours(), _sd_scripts(), _musubi())}
    for point in entry_points(group=ENTRY_POINT_GROUP):
        try:
            kind = point.load()
        except Exception as error:  # noqa: BLE001 - a broken plugin is one line, never a traceback
            raise UserError(f"engine {point.name!r} ({point.value}): cannot load it ({error})") from None
        if not isinstance(kind, EngineKind) or kind.name in kinds or kind.trainer is None:
            raise UserError(f"engine {point.name!r} ({point.value}): not a new external EngineKind")
        kinds[kind.name] = kind
    return kinds


def parse_engine(value: str | None) -> tuple[EngineKind, Path | None]:
    """``--engine``'s value as (engine, PATH); None: ours. An unknown name or a missing PATH is one line."""
    kinds = registered_engines()
    if not value:
        return kinds[OURS], None
    name, sep, path = value.partition("=")
    external = [kind for kind in kinds.values() if kind.trainer is not None]
    if name not in kinds or kinds[name].trainer is None or not sep or not path:
        listing = " or ".join(f"{kind.name}=PATH ({kind.checkout})" for kind in external)
        raise UserError(f"--engine {value}: expected {listing}")
    return kinds[name], Path(path).expanduser()


def engine_for(family: FamilySpec) -> EngineKind:
    """The engine that trains ``family``: ours where it can, else the registered trainer of its kind."""
    kinds = registered_engines()
    return next((kind for kind in kinds.values() if kind.trains(family)), kinds[OURS])


def check_engine(args: argparse.Namespace, family: FamilySpec | None) -> EngineKind:
    """The chosen engine (``--engine``, else ours), after its cheap refusals before planning: a family it does
    not train (naming the engine that does; ``family``: the model's, None when not known yet), then its own (its
    PATH, its Python, the model it can load)."""
    kind, _ = parse_engine(getattr(args, "engine", None))
    if family is not None:
        check_engine_trains(kind, family, args.model)
    kind.check(args)
    return kind


def check_engine_trains(kind: EngineKind, family: FamilySpec, model: str) -> None:
    """A family the chosen engine does not train is one line before planning, naming the engine that does."""
    if kind.trains(family):
        return
    right = engine_for(family)
    if kind.trainer is None:
        raise UserError(f"{model}: {family.description} is planned by lora-autotune but trained by {right.name} "
                        f"({family.kohya_script}); add {right.option} ({right.checkout}), or write its files with "
                        "autotune plan --out DIR")
    how = f"use {right.option} ({right.checkout})" if right.trainer else "drop --engine (autotune's engine)"
    raise UserError(f"{model}: {family.description} is not trained by {kind.name}; {how}")
