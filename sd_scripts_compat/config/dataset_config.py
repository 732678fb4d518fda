"""kohya's ``--dataset_config`` file ([general] / [[datasets]] / [[datasets.subsets]]) and the
``train_data_dir`` folder convention, read into :class:`DatasetGroupSpec`.

Validation follows sd-scripts' schema (library/config_util.py): the same keys per level, "extra keys
not allowed", and strict types where kohya is strict (``network_multiplier``, ``validation_split`` and
``face_crop_aug_range`` want floats; an integer there is an error, as voluptuous makes it). Unlike
sd-scripts, every error is one line naming the file, the place and the fix.

Validation is hand-written from the tables below rather than with voluptuous: it is a 40-key schema,
and a table lets the error name the level a misplaced key belongs to, with no extra dependency.
"""

from __future__ import annotations

import difflib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from sd_scripts_compat.config.bounds import bound_problem
from sd_scripts_compat.facts.dataset_spec import (
    MIN_REPEATS,
    DatasetGroupSpec,
    DatasetSpec,
    SubsetSpec,
    parse_repeat_folder,
)
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.kohya_toml import read_toml

log = logging.getLogger(__name__)

# --- schema (facts from sd-scripts' config_util.py) -------------------------------------------------
# Type tags: "bool"; "int"; "float" (strict: an integer is rejected, like voluptuous' `float`);
# "number" (int or float, kohya's Any(float, int)); "str"; "table"; "float_pair" ([float, float]);
# "resolution" (int or [int, int]).
SUBSET_ASCENDABLE: dict[str, str] = {
    "color_aug": "bool",
    "face_crop_aug_range": "float_pair",
    "flip_aug": "bool",
    "num_repeats": "int",
    "random_crop": "bool",
    "shuffle_caption": "bool",
    "keep_tokens": "int",
    "keep_tokens_separator": "str",
    "secondary_separator": "str",
    "caption_separator": "str",
    "enable_wildcard": "bool",
    "token_warmup_min": "int",
    "token_warmup_step": "number",
    "caption_prefix": "str",
    "caption_suffix": "str",
    "custom_attributes": "table",
    "resize_interpolation": "str",
}
DROPOUT_ASCENDABLE: dict[str, str] = {
    "caption_dropout_every_n_epochs": "int",
    "caption_dropout_rate": "number",
    "caption_tag_dropout_rate": "number",
}
DREAMBOOTH_ASCENDABLE: dict[str, str] = {"caption_extension": "str", "class_tokens": "str", "cache_info": "bool"}
DREAMBOOTH_SUBSET_ONLY: dict[str, str] = {"image_dir": "str", "is_reg": "bool", "alpha_mask": "bool"}
FINETUNE_SUBSET_ONLY: dict[str, str] = {"metadata_file": "str", "image_dir": "str", "alpha_mask": "bool"}
DATASET_ASCENDABLE: dict[str, str] = {
    "batch_size": "int",
    "bucket_no_upscale": "bool",
    "bucket_reso_steps": "int",
    "enable_bucket": "bool",
    "max_bucket_reso": "int",
    "min_bucket_reso": "int",
    "validation_seed": "int",
    "validation_split": "float",
    "resolution": "resolution",
    "network_multiplier": "float",
    "resize_interpolation": "str",
}
GENERAL_KEYS = {**DATASET_ASCENDABLE, **SUBSET_ASCENDABLE, **DREAMBOOTH_ASCENDABLE, **DROPOUT_ASCENDABLE}
DREAMBOOTH_DATASET_KEYS = dict(GENERAL_KEYS)
FINETUNE_DATASET_KEYS = {**DATASET_ASCENDABLE, **SUBSET_ASCENDABLE, **DROPOUT_ASCENDABLE}
DREAMBOOTH_SUBSET_KEYS = {**SUBSET_ASCENDABLE, **DREAMBOOTH_SUBSET_ONLY, **DREAMBOOTH_ASCENDABLE,
                          **DROPOUT_ASCENDABLE}
FINETUNE_SUBSET_KEYS = {**SUBSET_ASCENDABLE, **FINETUNE_SUBSET_ONLY, **DROPOUT_ASCENDABLE}
REQUIRED_DREAMBOOTH_SUBSET = ("image_dir",)
REQUIRED_FINETUNE_SUBSET = ("metadata_file",)

# Keys the file may carry (kohya accepts them) but the dataset builder does not act on yet: set to a
# non-default value they get a warning, so nobody believes they took effect.
NOT_IMPLEMENTED_KEYS: frozenset[str] = frozenset({
    "secondary_separator", "enable_wildcard", "cache_info", "alpha_mask", "resize_interpolation",
    "metadata_file", "custom_attributes",
})
# sd-scripts' resize_interpolation names (the argparse choices plus "box", documented for datasets).
RESIZE_INTERPOLATIONS = ("lanczos", "nearest", "bilinear", "linear", "bicubic", "cubic", "area", "box")

_TYPE_WORDS = {
    "bool": "true or false",
    "int": "an integer",
    "float": "a float (write 1.0, not 1)",
    "number": "a number",
    "str": "a string",
    "table": "a table",
    "float_pair": "two floats such as [2.0, 4.0]",
    "resolution": "an integer or [width, height] such as 512 or [768, 512]",
}


class _Mismatch(Exception):
    pass


def describe_value(value: Any) -> str:
    """A TOML-flavoured description of a value for one-line errors ("integer 512", "string 'abc'")."""
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, int):
        return f"integer {value}"
    if isinstance(value, float):
        return f"float {value!r}"
    if isinstance(value, str):
        text = value if len(value) <= 40 else value[:37] + "..."
        return f"string {text!r}"
    if isinstance(value, Mapping):
        return "a table"
    if isinstance(value, (list, tuple)):
        text = repr(list(value))
        return f"array {text if len(text) <= 40 else text[:37] + '...'}"
    return type(value).__name__


def _convert(tag: str, value: Any) -> Any:
    """Check one value against its type tag; return it in the spec's type or raise _Mismatch."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if tag == "bool" and isinstance(value, bool):
        return value
    if tag == "int" and is_int:
        return value
    if tag == "float" and isinstance(value, float):
        return value
    if tag == "number" and (is_int or isinstance(value, float)):
        return float(value)
    if tag == "str" and isinstance(value, str):
        return value
    if tag == "table" and isinstance(value, Mapping):
        return dict(value)
    if tag == "float_pair" and isinstance(value, (list, tuple)) and len(value) == 2 \
            and all(isinstance(v, float) for v in value):
        return (value[0], value[1])
    if tag == "resolution":
        if is_int and value > 0:
            return (value, value)
        if isinstance(value, (list, tuple)) and len(value) == 2 \
                and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
            return (value[0], value[1])
    raise _Mismatch(_TYPE_WORDS[tag])


def _levels_allowing(key: str) -> list[str]:
    levels = []
    if key in GENERAL_KEYS:
        levels.append("[general]")
    if key in DREAMBOOTH_DATASET_KEYS or key in FINETUNE_DATASET_KEYS:
        levels.append("[[datasets]]")
    if key in DREAMBOOTH_SUBSET_KEYS or key in FINETUNE_SUBSET_KEYS:
        levels.append("[[datasets.subsets]]")
    return levels


def _extra_key_error(source: str, key: str, where: str, allowed: Mapping[str, str]) -> UserError:
    from sd_scripts_compat.facts.kohya_args import load_arg_specs

    levels = _levels_allowing(key)
    if levels:
        hint = f"; {key!r} belongs in {' or '.join(levels)}"
    elif key in load_arg_specs():
        hint = f"; {key!r} is a training option: put it in the --config_file TOML or on the command line"
    else:
        close = difflib.get_close_matches(key, list(allowed), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else f"; allowed here: {', '.join(sorted(allowed))}"
    return UserError(f"{source}: extra keys not allowed: {key!r} in {where}{hint}")


def _check_table(source: str, table: Any, where: str, allowed: Mapping[str, str],
                 extra: Sequence[str] = ()) -> dict[str, Any]:
    if not isinstance(table, Mapping):
        raise UserError(f"{source}: {where} must be a table, got {describe_value(table)}")
    checked: dict[str, Any] = {}
    for key, value in table.items():
        if key in extra:
            continue
        if key not in allowed:
            raise _extra_key_error(source, key, where, allowed)
        try:
            checked[key] = _convert(allowed[key], value)
        except _Mismatch as mismatch:
            raise UserError(f"{source}: {key} in {where}: expected {mismatch}, got {describe_value(value)}") from None
        problem = bound_problem(key, checked[key])
        if problem:
            raise UserError(f"{source}: {key} in {where}: {problem}")
        if key == "resize_interpolation" and value not in RESIZE_INTERPOLATIONS:
            raise UserError(f"{source}: resize_interpolation in {where}: {value!r} is not one of "
                            f"{', '.join(RESIZE_INTERPOLATIONS)}")
    return checked


def validate_user_config(user_config: object, source: str) -> dict[str, Any]:
    """Check a parsed dataset config against kohya's schema; return it with values converted.

    The result has ``general`` (dict) and ``datasets`` (list of dicts, each with ``subsets``).
    """
    if not isinstance(user_config, Mapping):
        raise UserError(f"{source}: a dataset config is a table with [general] and [[datasets]]")
    for key in user_config:
        if key not in ("general", "datasets"):
            close = difflib.get_close_matches(key, ["general", "datasets"], n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else "; only [general] and [[datasets]] are allowed"
            if not close and _levels_allowing(key):
                hint = f"; {key!r} belongs in {' or '.join(_levels_allowing(key))}"
            raise UserError(f"{source}: extra keys not allowed: {key!r} at the top level{hint}")
    general = _check_table(source, user_config.get("general", {}), "[general]", GENERAL_KEYS)
    datasets_in = user_config.get("datasets", [])
    if not isinstance(datasets_in, list):
        raise UserError(f"{source}: 'datasets' must be written as [[datasets]] tables, "
                        f"got {describe_value(datasets_in)}")
    datasets = []
    for d_index, dataset in enumerate(datasets_in, start=1):
        where = f"[[datasets]] #{d_index}"
        if not isinstance(dataset, Mapping):
            raise UserError(f"{source}: {where} must be a table, got {describe_value(dataset)}")
        subsets_in = dataset.get("subsets", [])
        if not isinstance(subsets_in, list) or not all(isinstance(s, Mapping) for s in subsets_in):
            raise UserError(f"{source}: 'subsets' in {where} must be written as [[datasets.subsets]] tables")
        if not subsets_in:
            raise UserError(f"{source}: {where} has no [[datasets.subsets]]; add one with image_dir = '...'")
        finetune = ["metadata_file" in s for s in subsets_in]
        if any(finetune) and not all(finetune):
            raise UserError(f"{source}: {where} mixes DreamBooth subsets (image_dir) and fine-tuning subsets "
                            "(metadata_file); put them in separate [[datasets]]")
        is_finetune = all(finetune)
        checked = _check_table(source, dataset, where,
                               FINETUNE_DATASET_KEYS if is_finetune else DREAMBOOTH_DATASET_KEYS, extra=("subsets",))
        subsets = []
        for s_index, subset in enumerate(subsets_in, start=1):
            s_where = f"[[datasets.subsets]] #{s_index} of {where}"
            allowed = FINETUNE_SUBSET_KEYS if is_finetune else DREAMBOOTH_SUBSET_KEYS
            s_checked = _check_table(source, subset, s_where, allowed)
            for required in REQUIRED_FINETUNE_SUBSET if is_finetune else REQUIRED_DREAMBOOTH_SUBSET:
                if required not in s_checked:
                    raise UserError(f"{source}: {s_where} needs {required} = '...'")
            subsets.append(s_checked)
        checked["subsets"] = subsets
        datasets.append(checked)
    return {"general": general, "datasets": datasets}


def read_dataset_config(path: str | Path) -> dict[str, Any]:
    """Parse a dataset config (.toml, or .json as sd-scripts also allows) and validate it."""
    path = Path(path)
    source = str(path)
    if not path.is_file():
        raise UserError(f"{source}: dataset config not found (--dataset_config)")
    if path.suffix.lower() != ".json":
        return validate_user_config(read_toml(path, "dataset config"), source)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"{source}: cannot read the dataset config: {error}") from None
    except json.JSONDecodeError as error:
        raise UserError(f"{source}:{error.lineno}: malformed JSON: {error.msg} (column {error.colno})") from None
    return validate_user_config(data, source)


_MISSING = object()


def _pick(name: str, layers: Sequence[Mapping[str, Any]]) -> Any:
    """kohya's fallback search: the first layer holding a value that is not None."""
    for layer in layers:
        value = layer.get(name)
        if value is not None:
            return value
    return _MISSING


def build_dataset_group(user_config: Mapping[str, Any], args: Mapping[str, Any], *, source: str,
                        default_resolution: tuple[int, int] | None = None) -> DatasetGroupSpec:
    """Merge a validated user config with the command-line layer: subset > dataset > [general] > args > defaults.

    ``args`` holds the training config's values under dataset-config names (``batch_size``, not
    ``train_batch_size``); values that are None count as absent, as in sd-scripts.
    """
    general = user_config.get("general", {})
    subset_names = [f.name for f in fields(SubsetSpec)]
    dataset_names = [f.name for f in fields(DatasetSpec) if f.name != "subsets"]
    datasets = []
    for d_index, dataset in enumerate(user_config.get("datasets", []), start=1):
        subsets = []
        for subset in dataset["subsets"]:
            layers = (subset, dataset, general, args)
            values = {name: _pick(name, layers) for name in subset_names}
            values = {name: value for name, value in values.items() if value is not _MISSING}
            values.setdefault("image_dir", "")  # fine-tuning subsets may omit it
            subsets.append(SubsetSpec(**values))
        values = {name: _pick(name, (dataset, general, args)) for name in dataset_names}
        values = {name: value for name, value in values.items() if value is not _MISSING}
        if "resolution" not in values:
            if default_resolution is None:
                raise UserError(f"{source}: no resolution for [[datasets]] #{d_index}: set resolution = 512 in "
                                "[general] or [[datasets]], or resolution = \"512,512\" in the training config")
            values["resolution"] = tuple(default_resolution)
        datasets.append(DatasetSpec(subsets=tuple(subsets), **values))
    group = DatasetGroupSpec(datasets=tuple(datasets))
    _warn_not_implemented(group, source)
    return group


def _warn_not_implemented(group: DatasetGroupSpec, source: str) -> None:
    subset_defaults = {f.name: f.default for f in fields(SubsetSpec)}
    dataset_defaults = {f.name: f.default for f in fields(DatasetSpec) if f.name != "subsets"}
    seen = set()
    for dataset in group.datasets:
        for name in NOT_IMPLEMENTED_KEYS & dataset_defaults.keys():
            if getattr(dataset, name) != dataset_defaults[name]:
                seen.add(name)
        for subset in dataset.subsets:
            for name in NOT_IMPLEMENTED_KEYS:
                if getattr(subset, name) != subset_defaults[name]:
                    seen.add(name)
    for name in sorted(seen):
        log.warning("%s: %s is a kohya dataset option this engine does not implement yet; it has no effect",
                    source, name)


def load_dataset_config(path: str | Path, args: Mapping[str, Any] | None = None, *,
                        default_resolution: tuple[int, int] | None = None) -> DatasetGroupSpec:
    """Read, validate and merge a ``--dataset_config`` file into a DatasetGroupSpec."""
    user_config = read_dataset_config(path)
    return build_dataset_group(user_config, args or {}, source=str(path), default_resolution=default_resolution)


def folder_subsets(data_dir: str | Path, *, is_reg: bool, option: str) -> list[dict[str, Any]]:
    """Subsets from kohya's DreamBooth folder convention: ``<data_dir>/<N>_<class tokens>/``.

    ``10_sks dog`` gives 10 repeats and class tokens "sks dog"; a folder whose name does not start
    with an integer (or starts with one below 1) is skipped with a warning, as sd-scripts does
    (the rule is ``facts.dataset_spec.parse_repeat_folder``, shared with autotune's dataset scan).
    Subfolders are taken in sorted order so runs do not depend on the file system's listing order.
    """
    root = Path(data_dir)
    if not root.is_dir():
        raise UserError(f"{option} = {str(data_dir)!r}: folder not found")
    subsets = []
    for sub in sorted(p for p in root.iterdir() if p.is_dir()):
        parsed = parse_repeat_folder(sub.name)
        if parsed is None:
            log.warning("%s: skipping folder %r: its name does not start with a repeat count (e.g. '10_sks dog')",
                        option, sub.name)
            continue
        repeats, tail = parsed
        if repeats < MIN_REPEATS:
            log.warning("%s: skipping folder %r: repeat count %d is below 1", option, sub.name, repeats)
            continue
        subsets.append({"image_dir": str(sub), "num_repeats": repeats, "class_tokens": tail, "is_reg": is_reg})
    return subsets


def folder_dataset_group(train_data_dir: str | Path, reg_data_dir: str | Path | None, args: Mapping[str, Any], *,
                         default_resolution: tuple[int, int] | None = None) -> DatasetGroupSpec:
    """One dataset from ``train_data_dir`` (+ ``reg_data_dir``) folders, with the command-line layer applied."""
    subsets = folder_subsets(train_data_dir, is_reg=False, option="train_data_dir")
    own = parse_repeat_folder(Path(train_data_dir).name)
    if not subsets and own is not None and own[0] >= MIN_REPEATS:
        raise UserError(f"train_data_dir = {str(train_data_dir)!r} is itself an N_name folder; train_data_dir holds "
                        f"N_name folders: give its parent {str(Path(train_data_dir).resolve().parent)!r}")
    if not subsets:
        raise UserError(f"train_data_dir = {str(train_data_dir)!r} has no '<repeats>_<class tokens>' subfolder "
                        "such as '10_sks dog'; put the images in one")
    if reg_data_dir:
        subsets += folder_subsets(reg_data_dir, is_reg=True, option="reg_data_dir")
    user_config = {"general": {}, "datasets": [{"subsets": subsets}]}
    return build_dataset_group(user_config, args, source="train_data_dir", default_resolution=default_resolution)
