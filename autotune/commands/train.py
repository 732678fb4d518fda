"""Train with a kohya config: ``autotune train config.toml [--dataset_config d.toml] [kohya flags]``.

The same as ``python -m sd_scripts_compat.train_network`` (or ``sdxl_train_network`` /
``flux_train_network``), picking the entry point from the model's family, so a config that works with
sd-scripts runs here unchanged.
``--engine sd-scripts=PATH [--python PY]`` (anywhere after CONFIG) runs the user's own sd-scripts
instead, after checking that it imports and knows every option of the config.
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
    from sd_scripts_compat.facts.kohya_toml import flat_values, read_toml

    if "--pretrained_model_name_or_path" in kohya_args:
        index = kohya_args.index("--pretrained_model_name_or_path")
        return kohya_args[index + 1] if index + 1 < len(kohya_args) else None
    value = flat_values(read_toml(config)).get("pretrained_model_name_or_path")
    return str(value) if value else None


def own_options(kohya_args: list[str]) -> tuple[dict[str, str], list[str]]:
    """``--engine X`` / ``--python Y`` (ours; sd-scripts has neither) pulled out of the flags after CONFIG."""
    ours: dict[str, str] = {}
    rest: list[str] = []
    words = iter(kohya_args)
    for word in words:
        name, sep, value = word.partition("=")
        if name in ("--engine", "--python"):
            ours[name[2:]] = value if sep else next(words, "")
        else:
            rest.append(word)
    return ours, rest


def engine_script(model: str, config: Path, kohya_args: list[str]) -> str:
    """The engine entry point that trains the model (its family's ``kohya_script``: train_network,
    sdxl_train_network or flux_train_network). A pickle checkpoint's family cannot be read from a header:
    without ``--allow_pickle`` it is the engine's one-line refusal now, with it the file's keys are read (the
    engine loads it again; pickles are the slow path)."""
    from sd_scripts_compat.facts.errors import UserError
    from sd_scripts_compat.facts.kohya_toml import flat_values, read_toml
    from sd_scripts_compat.models.checkpoint import PICKLE_SUFFIXES, detect_layout, read_checkpoint
    from sd_scripts_compat.models.detect import detect_family

    if Path(model).suffix.lower() not in PICKLE_SUFFIXES or not Path(model).is_file():
        return detect_family(model).script
    if "--allow_pickle" not in kohya_args and flat_values(read_toml(config)).get("allow_pickle") is not True:
        raise UserError(f"{model} is a pickle checkpoint, which can run code when loaded; convert it to "
                        ".safetensors (preferred) or pass --allow_pickle to load it with weights_only=True")
    layout = detect_layout(read_checkpoint(model, allow_pickle=True, header_only=True))
    return "sdxl_train_network" if layout == "sdxl" else "train_network"


def run(args: argparse.Namespace) -> int:
    from sd_scripts_compat.facts.errors import UserError

    config = Path(args.config)
    ours, kohya_args = own_options(args.kohya_args)
    model = model_of_config(config, kohya_args)
    if model is None:
        raise UserError(f"{config}: no pretrained_model_name_or_path; add it to the config or the command line")
    if ours.get("engine"):
        from autotune.launch.engines import parse_engine

        kind, _ = parse_engine(ours["engine"])
        if kind.train_config is None:
            raise UserError(f"--engine {ours['engine']}: {kind.name} does not run a kohya config by itself; use "
                            "autotune run DATASET --engine ... (it plans the engine's own files)")
        return kind.train_config(ours["engine"], ours.get("python"), model=model, config=config,
                                 kohya_args=kohya_args)
    from sd_scripts_compat.train_network import main

    return main(["--config_file", str(config), *kohya_args], script=engine_script(model, config, kohya_args))
