"""The sd-scripts settings a GUI user sets by hand and the planner only defaults: the scheduler and its warm-up,
how often to save and how many to keep, sample prompts and their rhythm, noise offset, min-SNR gamma, the seed.

Each is an option of ``plan`` and ``run`` under sd-scripts' own name (``--lr_scheduler cosine_with_restarts``,
``--sample_prompts prompts.txt``; ``--lr-scheduler`` too), typed, bounded and with the choices sd-scripts' argument
table gives it (the engine's facts: ``kohya_args``, ``bounds``, ``optimizers.SCHEDULERS``), so no second copy of
a type or a range lives here. The plan writes a given value in place of its own, with the reason "yours"
(``planning.choices.user_settings``); nothing else changes with it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

# the settings, by the plan options' group (plan_options' titles) they appear in, in their order there
SETTINGS: dict[str, tuple[str, ...]] = {
    "optimizer and schedule": ("lr_scheduler", "lr_warmup_steps", "lr_scheduler_num_cycles", "max_grad_norm"),
    "saving and samples": ("save_every_n_epochs", "save_every_n_steps", "save_last_n_epochs", "save_last_n_steps",
                           "sample_prompts", "sample_every_n_steps", "sample_every_n_epochs", "sample_sampler",
                           "sample_at_first"),
    "advanced": ("seed", "noise_offset", "min_snr_gamma", "clip_skip"),
}
PATH_SETTINGS = ("sample_prompts",)  # a file the run reads: made absolute, and checked to be there
HELP = {
    "lr_scheduler": "the learning-rate schedule (default: the plan's cosine)",
    "lr_warmup_steps": "steps of warm-up (a number below 1: that share of the steps; default: the plan's 5 percent)",
    "lr_scheduler_num_cycles": "restarts of cosine_with_restarts",
    "max_grad_norm": "clip gradients to this norm (0: no clipping)",
    "save_every_n_epochs": "save a LoRA every N epochs (default: about four LoRA files in the run)",
    "save_every_n_steps": "save a LoRA every N steps",
    "save_last_n_epochs": "keep only the last N epochs' LoRA files",
    "save_last_n_steps": "keep only the LoRA files of the last N steps",
    "sample_prompts": "a text file of prompts, one per line, with sd-scripts' --w --h --s --d --l options",
    "sample_every_n_steps": "draw the sample prompts every N steps",
    "sample_every_n_epochs": "draw the sample prompts every N epochs",
    "sample_sampler": "the sampler the samples are drawn with",
    "sample_at_first": "draw the samples once before training too",
    "seed": "the random seed (default: the plan's 42)",
    "noise_offset": "noise offset (0.05-0.1 helps very dark and bright images)",
    "min_snr_gamma": "min-SNR loss weighting (5 is the paper's)",
    "clip_skip": "use the text encoder's N-th last layer (2 for many anime models)",
}


def setting_dest(key: str) -> str:
    return f"setting_{key}"


def add_setting_arguments(groups: dict[str, argparse._ArgumentGroup]) -> None:
    """Each setting as an option of its group: ``--KEY`` (and ``--KEY`` with hyphens), as sd-scripts types it."""
    from sd_scripts_compat.facts.kohya_args import load_arg_specs
    from sd_scripts_compat.facts.optimizers import SCHEDULERS

    specs = load_arg_specs()
    for title, keys in SETTINGS.items():
        for key in keys:
            spec = specs[key]
            names = list(dict.fromkeys((f"--{key}", f"--{key.replace('_', '-')}")))  # --seed once
            common: dict[str, Any] = {"dest": setting_dest(key), "default": None, "help": HELP[key]}
            if spec.kind == "store_true":
                groups[title].add_argument(*names, action="store_true", **common)
                continue
            choices = SCHEDULERS if key == "lr_scheduler" else spec.choices
            groups[title].add_argument(*names, type=_converter(key, spec.kind), metavar=key.upper(),
                                       choices=[c for c in choices if c is not None] if choices else None, **common)


def _converter(key: str, kind: str) -> Callable[[str], Any]:
    """An argparse type for one setting: sd-scripts' kind, then the engine's bounds for the key."""
    from autotune.launch.arg_types import finite
    from sd_scripts_compat.config.bounds import bound_problem
    from sd_scripts_compat.facts.kohya_args import int_or_float

    parsers: dict[str, Callable[[str], Any]] = {"int": int, "float": finite, "int_or_float": int_or_float}
    parse = parsers.get(kind, str)

    def convert(text: str) -> Any:
        value = parse(text)
        problem = bound_problem(key, value)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    convert.__name__ = {"int": "integer", "float": "finite number", "int_or_float": "finite number"}.get(kind, "text")
    return convert


def given_settings(args: argparse.Namespace) -> tuple[tuple[str, Any], ...]:
    """The settings the user gave, as (sd-scripts key, value); a file setting as an absolute path that exists
    (else one line naming the option)."""
    from sd_scripts_compat.facts.errors import UserError

    out = []
    for keys in SETTINGS.values():
        for key in keys:
            value = getattr(args, setting_dest(key), None)
            if value is None or value is False:
                continue
            if key in PATH_SETTINGS:
                path = Path(value).expanduser().resolve()
                if not path.is_file():
                    raise UserError(f"--{key} {value}: no such file; give a text file of prompts, one per line")
                value = str(path)
            out.append((key, value))
    return tuple(out)
