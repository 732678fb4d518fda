"""Train with a kohya config: ``autotune train config.toml [--dataset_config d.toml] [kohya flags]``.

The same as ``python -m sd_scripts_compat.train_network`` (or ``sdxl_train_network``), picking the
entry point from the model's family, so a config that works with sd-scripts runs here unchanged.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="a kohya / lora-scripts config.toml")
    parser.add_argument("kohya_args", nargs=argparse.REMAINDER,
                        help="further sd-scripts flags (they override the config), e.g. --max_train_steps 100")


def model_of_config(config: Path, kohya_args: list[str]) -> str | None:
    """The base model named on the command line or in the config (sections flattened, as sd-scripts does)."""
    from sd_scripts_compat.config.kohya_toml import flat_values, read_toml

    if "--pretrained_model_name_or_path" in kohya_args:
        index = kohya_args.index("--pretrained_model_name_or_path")
        return kohya_args[index + 1] if index + 1 < len(kohya_args) else None
    value = flat_values(read_toml(config)).get("pretrained_model_name_or_path")
    return str(value) if value else None


def is_sdxl(model: str, config: Path, kohya_args: list[str]) -> bool:
    """Whether the model is SDXL (which engine entry point trains it). A pickle checkpoint's family cannot be
    read from a header: without ``--allow_pickle`` it is the engine's one-line refusal now, with it the file's
    keys are read (the engine loads it again; pickles are the slow path)."""
    from sd_scripts_compat.config.kohya_toml import flat_values, read_toml
    from sd_scripts_compat.errors import UserError
    from sd_scripts_compat.models.detect import detect_family
    from sd_scripts_compat.models.single_file import PICKLE_SUFFIXES, detect_layout, read_checkpoint

    if Path(model).suffix.lower() not in PICKLE_SUFFIXES or not Path(model).is_file():
        return detect_family(model).is_sdxl
    if "--allow_pickle" not in kohya_args and flat_values(read_toml(config)).get("allow_pickle") is not True:
        raise UserError(f"{model} is a pickle checkpoint, which can run code when loaded; convert it to "
                        ".safetensors (preferred) or pass --allow_pickle to load it with weights_only=True")
    return detect_layout(read_checkpoint(model, allow_pickle=True, header_only=True)) == "sdxl"


def run(args: argparse.Namespace) -> int:
    from sd_scripts_compat.errors import UserError
    from sd_scripts_compat.train_network import main

    config = Path(args.config)
    model = model_of_config(config, args.kohya_args)
    if model is None:
        raise UserError(f"{config}: no pretrained_model_name_or_path; add it to the config or the command line")
    return main(["--config_file", str(config), *args.kohya_args], sdxl=is_sdxl(model, config, args.kohya_args))
