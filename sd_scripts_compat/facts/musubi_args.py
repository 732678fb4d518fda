"""musubi-tuner's command-line options as data: one table per script (training and both caching steps of
Qwen-Image, FLUX.2, Wan and Z-Image), read from ``data/musubi/<script>_args.tsv`` (name, kind, default, choices,
script-only; dumped from each script's own parser). The planner's musubi commands and config are checked against
them, so an option musubi does not take, or a value outside its choices, never reaches the user's checkout.
"""

from __future__ import annotations

import ast
import csv
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from sd_scripts_compat.facts.errors import UserError

MUSUBI_DATA = Path(__file__).resolve().parents[1] / "data" / "musubi"
# kohya's option names that musubi spells otherwise (the one settings shape is kohya's)
MUSUBI_NAMES = {"cpu_offload_checkpointing": "gradient_checkpointing_cpu_offload"}


@dataclass(frozen=True)
class MusubiOption:
    name: str
    kind: str  # flag, int, float, str, Path, _int_or_float, list[str], list[float]
    default: Any
    choices: tuple[Any, ...] | None


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


@cache
def musubi_options(script: str) -> dict[str, MusubiOption]:
    """Every option of musubi's ``script`` ("qwen_image_train_network", "wan_cache_latents", ...)."""
    path = MUSUBI_DATA / f"{script.removesuffix('.py')}_args.tsv"
    if not path.is_file():
        known = sorted(p.name.removesuffix("_args.tsv") for p in MUSUBI_DATA.glob("*_args.tsv"))
        raise KeyError(f"no option table for musubi-tuner's {script}; known: {', '.join(known)}")
    with path.open(encoding="utf-8", newline="") as handle:
        rows = list(csv.DictReader(handle, delimiter="\t"))
    out = {}
    for row in rows:
        choices = _literal(row["choices"]) if row["choices"] else None
        out[row["name"]] = MusubiOption(row["name"], row["kind"], _literal(row["default"]),
                                        tuple(choices) if isinstance(choices, list) else None)
    return out


def check_musubi_value(script: str, name: str, value: Any) -> None:
    """``value`` is one musubi's ``script`` accepts for ``--name`` (kind and choices); else a one-line UserError."""
    options = musubi_options(script)
    if name not in options:
        raise UserError(f"--{name} is not an option of musubi-tuner's {script}.py")
    option = options[name]
    if option.kind == "flag":
        ok = isinstance(value, bool)
    elif option.kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif option.kind in ("float", "_int_or_float"):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif option.kind.startswith("list["):
        ok = isinstance(value, (list, tuple))
    else:
        ok = isinstance(value, (str, Path))
    if not ok:
        raise UserError(f"--{name} {value!r}: musubi-tuner's {script}.py takes a {option.kind} value")
    if option.choices is not None and value not in option.choices:
        raise UserError(f"--{name} {value!r}: musubi-tuner's {script}.py takes one of "
                        f"{', '.join(map(str, option.choices))}")


def musubi_argv(script: str, options: dict[str, Any]) -> list[str]:
    """``--name value`` words for ``options`` (a flag only when true; lists as several words), each checked."""
    words: list[str] = []
    for name, value in options.items():
        check_musubi_value(script, name, value)
        if isinstance(value, bool):
            words += [f"--{name}"] if value else []
        elif isinstance(value, (list, tuple)):
            words += [f"--{name}", *map(str, value)]
        else:
            words += [f"--{name}", str(value)]
    return words
