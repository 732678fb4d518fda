"""The plan options' argparse types: numbers that are finite, optimizer and LoRA names, a resolution. Their
``__name__`` is what argparse's messages and the web app's schema (``ui.schemas``) read them as."""

from __future__ import annotations

import argparse


def finite(text: str) -> float:
    """An argparse type: a number that is not nan or inf (Python's float() takes both)."""
    import math

    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


finite.__name__ = "finite number"


def optimizer_name(text: str) -> str:
    """An argparse type: an optimizer by kohya's name in any case (sd-scripts compares them case-insensitively),
    as its canonical spelling ("adamw8bit" -> "AdamW8bit"); an unknown one is left for ``choices`` to refuse."""
    from sd_scripts_compat.facts.optimizers import optimizer_names

    by_key = {name.lower(): name for name in optimizer_names()}
    return by_key.get(text.strip().lower(), text)


def lora_name(text: str) -> str:
    """``--output-name``: the LoRA file's name, one safe path part (it names files beside the config)."""
    from autotune.layout import is_run_name

    if not is_run_name(text):
        raise argparse.ArgumentTypeError(f"{text!r}: letters, digits, '.', '-' and '_' only, no path (it names the "
                                         "LoRA file, e.g. my_style)")
    return text


def resolution_side(text: str) -> int:
    """``--resolution 768`` or kohya's ``768,768``; plans train square buckets of one area, so W,H must agree."""
    parts = [part.strip() for part in str(text).split(",")]
    if len(parts) not in (1, 2) or not all(part.isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: give one side in pixels (768) or W,H as kohya writes it "
                                         "(768,768)")
    if len(parts) == 2 and parts[0] != parts[1]:
        raise argparse.ArgumentTypeError(f"{text}: plans train square buckets (of that area, any aspect); give "
                                         f"one side, e.g. {int((int(parts[0]) * int(parts[1])) ** 0.5) // 64 * 64}, "
                                         "or set resolution in a --config")
    return int(parts[0])


resolution_side.__name__ = "resolution"
