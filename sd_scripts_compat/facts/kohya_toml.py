"""The one place kohya ``config.toml`` / ``dataset.toml`` files are read, merged and written.

sd-scripts reads both with the ``toml`` package (0.10.2, TOML 0.5: no mixed-type arrays). A training
config's sections are flattened one level (section names ignored, a key repeated later wins); a
dataset config keeps its ``[general]`` / ``[[datasets]]`` / ``[[datasets.subsets]]`` levels, and a
value is looked up subset > dataset > general > training config > defaults. The engine's config
reader, ``autotune train``, ``autotune run``, the planner's writer and the watchdog all go through
here, so every tool sees the same values kohya would.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sd_scripts_compat.facts.atomic import write_text_atomic
from sd_scripts_compat.facts.errors import UserError


def read_toml(path: str | os.PathLike[str], what: str = "config file") -> dict[str, Any]:
    """Parse a TOML file as sd-scripts does; anything unreadable is a one-line UserError naming the file."""
    import toml

    source = Path(path)
    try:
        data = source.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{source}: {what} not found") from None
    except OSError as error:
        raise UserError(f"{source}: cannot read the {what} ({error.strerror or error})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        encoding = "UTF-16" if data[:2] in (b"\xff\xfe", b"\xfe\xff") else "not UTF-8 text"
        raise UserError(f"{source}: the {what} is {encoding}; save it as UTF-8 TOML") from None
    if "\x00" in text:
        raise UserError(f"{source}: the {what} is a binary file, not TOML; give a kohya .toml file")
    try:
        return toml.loads(text)
    except toml.TomlDecodeError as error:
        raise UserError(f"{source}:{error.lineno}: malformed TOML: {error.msg} (line {error.lineno}, "
                        f"column {error.colno})") from None
    except (ValueError, IndexError, TypeError) as error:  # toml 0.10.2 raises these on some bad input
        raise UserError(f"{source}: malformed TOML: {error}") from None


def flatten(document: Mapping[str, Any], source: str = "config",
            warnings: list[str] | None = None) -> tuple[dict[str, Any], dict[str, str | None]]:
    """sd-scripts' flattening of a training config: tables give their keys, later keys win.

    Returns the flat values and, per key, the section it came from (None: top level). A key set twice
    with different values adds a warning to ``warnings``.
    """
    flat: dict[str, Any] = {}
    section_of: dict[str, str | None] = {}
    for key, value in document.items():
        items = value.items() if isinstance(value, dict) else [(key, value)]
        section = key if isinstance(value, dict) else None
        for inner_key, inner_value in items:
            if warnings is not None and inner_key in flat and flat[inner_key] != inner_value:
                before = section_of[inner_key]
                warnings.append(f"{source}: {inner_key} is set in [{before or 'top level'}] and again in "
                                f"[{section or 'top level'}]; the later value {inner_value!r} wins")
            flat[inner_key] = inner_value
            section_of[inner_key] = section
    return flat, section_of


def flat_values(document: Mapping[str, Any]) -> dict[str, Any]:
    """The training config's values as kohya sees them (sections flattened)."""
    return flatten(document)[0]


def dataset_blocks(dataset_document: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every table of a dataset config a key can sit in: [general], each [[datasets]], each subset."""
    blocks: list[dict[str, Any]] = []
    if isinstance(dataset_document.get("general"), dict):
        blocks.append(dataset_document["general"])
    for dataset in dataset_document.get("datasets") or []:
        if isinstance(dataset, dict):
            blocks.append(dataset)
            blocks.extend(s for s in dataset.get("subsets") or [] if isinstance(s, dict))
    return blocks


def set_config_values(document: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a training config with ``values`` set where kohya reads them.

    A key already present (top level or in any section) is replaced there, everywhere it occurs, so the
    flattened result holds the new value; a new key goes to the top level.
    """
    out = _copy(document)
    for key, value in values.items():
        placed = False
        if key in out and not isinstance(out[key], dict):
            out[key] = value
            placed = True
        for section in out.values():
            if isinstance(section, dict) and key in section:
                section[key] = value
                placed = True
        if not placed:
            out[key] = value
    return out


def without_keys(document: Mapping[str, Any], keys: set[str]) -> dict[str, Any]:
    """A copy of a kohya config without ``keys``, at the top level and in every section."""
    out: dict[str, Any] = {}
    for key, value in document.items():
        if isinstance(value, dict):
            out[key] = {k: v for k, v in value.items() if k not in keys}
        elif key not in keys:
            out[key] = value
    return out


def set_dataset_values(document: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a dataset config with dataset-level ``values`` (``batch_size``, ``resolution``, bucket
    limits) set on every ``[[datasets]]`` block and wherever else they already are, so they win over
    anything the training config says (kohya: dataset > general > config)."""
    out = _copy(document)
    for block in dataset_blocks(out):
        for key, value in values.items():
            if key in block:
                block[key] = value
    for dataset in out.get("datasets") or []:
        if isinstance(dataset, dict):
            for key, value in values.items():
                dataset[key] = value
    return out


def encode_value(value: Any) -> str:
    """One TOML value as the ``toml`` package writes it; arrays must be homogeneous (TOML 0.5)."""
    import toml

    if isinstance(value, (list, tuple)):
        kinds = {type(item) for item in value}
        if len(kinds) > 1:
            raise ValueError(f"mixed-type array {value!r}: TOML 0.5 (sd-scripts' toml package) rejects it")
        return "[" + ", ".join(encode_value(item) for item in value) + "]"
    if isinstance(value, dict) or value is None:
        raise ValueError(f"{value!r}: not a kohya option value")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{value!r}: TOML 0.5 has no inf/nan")
    line = toml.dumps({"v": value})
    return line.split("=", 1)[1].strip()


def loads(text: str) -> dict[str, Any]:
    """Parse TOML text with sd-scripts' parser (for round-trip checks of text we wrote)."""
    import toml

    return toml.loads(text)


def dumps(document: Mapping[str, Any]) -> str:
    import toml

    return toml.dumps(_copy(document))


def write_toml(path: str | os.PathLike[str], document: Mapping[str, Any], header: str = "") -> None:
    """Write a TOML document atomically; it is parsed back first, so a file kohya cannot read is never written."""
    text = header + dumps(document)
    if loads(text) != _copy(document):
        raise AssertionError(f"{path}: the TOML written does not parse back to the same values")
    write_text_atomic(path, text)


def parse_resolution(value: Any) -> tuple[int, int]:
    """kohya's resolution: "W,H", "S", an int or a 1-2 element list -> (W, H)."""
    if isinstance(value, (list, tuple)):
        items = [int(v) for v in value]
    elif isinstance(value, str):
        items = [int(v.strip()) for v in value.split(",") if v.strip()]
    else:
        items = [int(value)]
    if len(items) == 1:
        items *= 2
    return items[0], items[1]


def _copy(document: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of a TOML document as ``toml.loads`` would give it back (tuples become lists)."""
    out: dict[str, Any] = {}
    for key, value in document.items():
        if isinstance(value, Mapping):
            out[key] = _copy(value)
        elif isinstance(value, (list, tuple)):
            out[key] = [_copy(v) if isinstance(v, Mapping) else v for v in value]
        else:
            out[key] = value
    return out

