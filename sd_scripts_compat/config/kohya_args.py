"""sd-scripts' command-line options as data: names, kinds, defaults and choices.

``data/kohya_train_network_args.tsv`` lists every option that sd-scripts' ``train_network.py`` and
``sdxl_train_network.py`` accept (a copy of the reference list). Everything that needs kohya's
argument names -- the argparse parser of our entry points, the TOML reader, config generators --
reads this table instead of repeating it, so the names cannot drift apart.
"""

from __future__ import annotations

import argparse
import ast
import csv
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from sd_scripts_compat.errors import UserError

ARGS_TSV = Path(__file__).resolve().parents[1] / "data" / "kohya_train_network_args.tsv"

# The kinds used in the table, and what argparse does with each.
KINDS = ("store_true", "int", "float", "str", "Path", "int_or_float", "str[nargs=*]", "float[nargs=*]")


@dataclass(frozen=True)
class ArgSpec:
    """One sd-scripts option. ``default`` and ``choices`` are Python values (parsed from the table)."""

    name: str
    kind: str
    default: Any
    choices: tuple[Any, ...] | None
    sdxl_only: bool

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
    raise ValueError(f"unknown kind {kind!r} in {ARGS_TSV.name}")


def _row_to_spec(row: dict[str, str]) -> ArgSpec:
    kind = row["kind"]
    if kind not in KINDS:
        raise ValueError(f"{ARGS_TSV.name}: option {row['name']!r} has unknown kind {kind!r}")
    default = _scalar_from_text(kind, row["default"])
    choices_text = row["choices"].strip()
    choices = tuple(_scalar_from_text(kind, c) for c in choices_text.split("|")) if choices_text else None
    return ArgSpec(name=row["name"], kind=kind, default=default, choices=choices, sdxl_only=row["sdxl_only"] == "yes")


@lru_cache(maxsize=1)
def load_arg_specs() -> dict[str, ArgSpec]:
    """All sd-scripts options by name, in the table's order (cached: the table never changes at run time)."""
    with ARGS_TSV.open(encoding="utf-8", newline="") as handle:
        rows = list(csv.DictReader(handle, delimiter="\t"))
    return {row["name"]: _row_to_spec(row) for row in rows}


def arg_specs(*, sdxl: bool) -> dict[str, ArgSpec]:
    """The options one entry point accepts: SDXL-only ones only for ``sdxl_train_network``."""
    return {name: spec for name, spec in load_arg_specs().items() if sdxl or not spec.sdxl_only}


class _OneLineErrorParser(argparse.ArgumentParser):
    """argparse prints usage and exits on bad input; we raise a one-line UserError instead."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"command line: {message}")


def build_argparser(sdxl: bool, *, suppress_defaults: bool = False) -> argparse.ArgumentParser:
    """argparse parser with kohya's option names, kinds, defaults and choices.

    ``suppress_defaults=True`` leaves options that were not typed out of the namespace, which is how
    the config reader tells "given on the command line" (overrides the TOML) from "default" (does not).
    Abbreviations are off: ``--learning`` must not silently mean ``--learning_rate``.
    """
    parser = _OneLineErrorParser(
        prog="sdxl_train_network" if sdxl else "train_network",
        description="LoRA training with sd-scripts' options (kohya-compatible).",
        allow_abbrev=False,
    )
    type_of = {"int": int, "float": float, "str": str, "Path": Path, "int_or_float": int_or_float,
               "str[nargs=*]": str, "float[nargs=*]": float}
    for spec in arg_specs(sdxl=sdxl).values():
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
