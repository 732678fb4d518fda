"""sd-scripts' command-line options as data: names, kinds, defaults and choices, per training script.

``data/kohya_train_network_args.tsv`` lists every option that sd-scripts' ``train_network.py`` and
``sdxl_train_network.py`` accept, ``data/kohya_flux_train_network_args.tsv`` every option of
``flux_train_network.py``, and one table each for ``sd3_train_network.py`` (our engine runs it too),
``lumina_train_network.py``, ``hunyuan_image_train_network.py`` and ``anima_train_network.py`` (copies of the
reference lists, in one notation: sd-scripts runs those three; our engine knows their options so that a config
meant for one is named as such, and the planner's configs for them are checked against them). Everything that
needs kohya's argument names -- the argparse parser of our entry points, the TOML reader, config generators --
reads these tables instead of repeating them, so the names cannot drift apart. Which table (and
which of its script-only rows) an entry point accepts is :data:`SCRIPTS`, data too.
"""

from __future__ import annotations

import argparse
import ast
import csv
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from sd_scripts_compat.facts.errors import UserError

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
ARGS_TSV = DATA_DIR / "kohya_train_network_args.tsv"
FLUX_ARGS_TSV = DATA_DIR / "kohya_flux_train_network_args.tsv"


def _table(script: str) -> Path:
    return DATA_DIR / f"kohya_{script}_args.tsv"


@dataclass(frozen=True)
class TrainingScript:
    """One sd-scripts entry point: its option table and whether it takes the table's script-only rows."""

    name: str  # "train_network", "sdxl_train_network", "flux_train_network"
    table: Path
    takes_only_rows: bool  # the last column ("sdxl_only" / "flux_only") marks rows only this script takes
    models: str  # what it trains, for messages
    runs_here: bool = True  # our engine has this entry point (False: sd-scripts runs it, we plan for it)


SCRIPTS: dict[str, TrainingScript] = {script.name: script for script in (
    TrainingScript("train_network", ARGS_TSV, False, "SD 1.x/2.x"),
    TrainingScript("sdxl_train_network", ARGS_TSV, True, "SDXL"),
    TrainingScript("flux_train_network", FLUX_ARGS_TSV, True, "FLUX.1 / Chroma"),
    TrainingScript("sd3_train_network", _table("sd3_train_network"), True, "SD3 / SD3.5"),
    TrainingScript("lumina_train_network", _table("lumina_train_network"), True, "Lumina Image 2.0", False),
    TrainingScript("hunyuan_image_train_network", _table("hunyuan_image_train_network"), True, "HunyuanImage-2.1",
                   False),
    TrainingScript("anima_train_network", _table("anima_train_network"), True, "Anima", False),
)}


def script_name(*, sdxl: bool = False, script: str | None = None) -> str:
    """The entry point meant: ``script`` when given, else SD 1.x/2.x or SDXL by the older ``sdxl`` flag."""
    if script is None:
        return "sdxl_train_network" if sdxl else "train_network"
    if script not in SCRIPTS:
        raise ValueError(f"unknown training script {script!r}; known: {', '.join(SCRIPTS)}")
    return script


# The kinds used in the table, and what argparse does with each.
KINDS = ("store_true", "int", "float", "str", "Path", "int_or_float", "str[nargs=*]", "float[nargs=*]")


@dataclass(frozen=True)
class ArgSpec:
    """One sd-scripts option. ``default`` and ``choices`` are Python values (parsed from the table)."""

    name: str
    kind: str
    default: Any
    choices: tuple[Any, ...] | None
    scripts: tuple[str, ...]  # the entry points that accept it (SCRIPTS' names)

    @property
    def sdxl_only(self) -> bool:
        """Accepted by SDXL's script but not SD 1.x/2.x's (cache_text_encoder_outputs, ...)."""
        return "sdxl_train_network" in self.scripts and "train_network" not in self.scripts

    @property
    def is_list(self) -> bool:
        return self.kind.endswith("[nargs=*]")


def int_or_float(text: str) -> int | float:
    """argparse type of ``lr_warmup_steps`` / ``lr_decay_steps``: a step count, or a float below 1 as a ratio."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int or float") from None
    if value >= 1:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: a value of 1 or more is a step count and must be an "
                                             "integer; a ratio must be below 1") from None
    return value


def _scalar_from_text(kind: str, text: str) -> Any:
    """Convert one default/choice cell of the table to the Python value argparse would hold."""
    if text == "None":
        return None
    if kind == "store_true":
        return text == "True"
    if kind in ("str", "Path", "str[nargs=*]"):
        value = ast.literal_eval(text) if text[:1] in ("'", '"') else text
        return value
    if kind == "int":
        return int(text)
    if kind in ("float", "float[nargs=*]"):
        return float(text)
    if kind == "int_or_float":
        value = ast.literal_eval(text)
        return value
    raise ValueError(f"unknown kind {kind!r} in an option table")


def _row_to_spec(row: dict[str, str], table: Path, only: bool) -> tuple[str, Any, tuple[Any, ...] | None, bool]:
    kind = row["kind"]
    if kind not in KINDS:
        raise ValueError(f"{table.name}: option {row['name']!r} has unknown kind {kind!r}")
    default = _scalar_from_text(kind, row["default"])
    choices_text = row["choices"].strip()
    choices = tuple(_scalar_from_text(kind, c) for c in choices_text.split("|")) if choices_text else None
    return kind, default, choices, only


@lru_cache(maxsize=8)
def _read_table(table: Path) -> dict[str, tuple[Any, ...]]:
    """One table: name -> (kind, default, choices, script-only), in its order."""
    with table.open(encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle, delimiter="\t")
        only_column = (reader.fieldnames or [])[-1]
        return {row["name"]: _row_to_spec(row, table, row[only_column] == "yes") for row in reader}


@lru_cache(maxsize=1)
def load_arg_specs() -> dict[str, ArgSpec]:
    """Every option any of our entry points accepts, by name (cached: the tables never change at run time)."""
    accepted: dict[str, list[str]] = {}
    facts: dict[str, tuple[Any, ...]] = {}
    for script in SCRIPTS.values():
        for name, row in _read_table(script.table).items():
            if script.takes_only_rows or not row[3]:
                accepted.setdefault(name, []).append(script.name)
                facts.setdefault(name, row)
    return {name: ArgSpec(name=name, kind=kind, default=default, choices=choices, scripts=tuple(accepted[name]))
            for name, (kind, default, choices, _) in facts.items()}


def arg_specs(*, sdxl: bool = False, script: str | None = None) -> dict[str, ArgSpec]:
    """The options one entry point accepts (``script``, or SD 1.x/2.x / SDXL by ``sdxl``)."""
    name = script_name(sdxl=sdxl, script=script)
    entry, every = SCRIPTS[name], load_arg_specs()
    # this script's own defaults and choices (discrete_flow_shift is 3.0 for FLUX.1, 6.0 for Lumina, ...)
    return {option: ArgSpec(option, kind, default, choices, every[option].scripts)
            for option, (kind, default, choices, only) in _read_table(entry.table).items()
            if entry.takes_only_rows or not only}


def scripts_text(spec: ArgSpec) -> str:
    """``"SDXL / FLUX.1 (sdxl_train_network, flux_train_network)"``: who takes an option, for messages; an option
    only scripts we do not run take says so (``"Lumina Image 2.0 (sd-scripts' lumina_train_network)"``)."""
    ours = any(SCRIPTS[s].runs_here for s in spec.scripts)
    return (" / ".join(SCRIPTS[s].models for s in spec.scripts)
            + f" ({'' if ours else 'sd-scripts: '}{', '.join(spec.scripts)})")


class _OneLineErrorParser(argparse.ArgumentParser):
    """argparse prints usage and exits on bad input; we raise a one-line UserError instead."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"command line: {message}")


def build_argparser(sdxl: bool = False, *, script: str | None = None, every_script: bool = False,
                    suppress_defaults: bool = False) -> argparse.ArgumentParser:
    """argparse parser with kohya's option names, kinds, defaults and choices.

    ``suppress_defaults=True`` leaves options that were not typed out of the namespace, which is how
    the config reader tells "given on the command line" (overrides the TOML) from "default" (does not).
    Abbreviations are off: ``--learning`` must not silently mean ``--learning_rate``. ``every_script``
    takes the options of all entry points (the config reader then names the one an option belongs to).
    """
    name = script_name(sdxl=sdxl, script=script)
    parser = _OneLineErrorParser(
        prog=name,
        description="LoRA training with sd-scripts' options (kohya-compatible).",
        allow_abbrev=False,
    )
    type_of = {"int": int, "float": float, "str": str, "Path": Path, "int_or_float": int_or_float,
               "str[nargs=*]": str, "float[nargs=*]": float}
    for spec in (load_arg_specs() if every_script else arg_specs(script=name)).values():
        default = argparse.SUPPRESS if suppress_defaults else spec.default
        if spec.kind == "store_true":
            parser.add_argument(f"--{spec.name}", action="store_true", default=default)
            continue
        kwargs: dict[str, Any] = {"type": type_of[spec.kind], "default": default}
        if spec.is_list:
            kwargs["nargs"] = "*"
        if spec.choices is not None:
            kwargs["choices"] = spec.choices
        parser.add_argument(f"--{spec.name}", **kwargs)
    return parser
