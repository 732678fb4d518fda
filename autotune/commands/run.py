"""Train a LoRA end to end: check the dataset, probe, plan (or take your config), then run the engine
under the watchdog, which steps down to settings that fit after an OOM, to safer settings after a
diverged (NaN or exploding) loss, and resumes from the last saved state.

    autotune run DATASET/ --model builtin:tiny-sd15
    autotune run DATASET/ --model model.safetensors --vram 8 --goal character
    autotune run DATASET/ --model PATH --config my.toml --out runs/x
    autotune run DATASET/ --model PATH --out runs/x --resume      # continue an interrupted run
"""

from __future__ import annotations

import argparse

from autotune.launch.run import add_arguments, start_run

__all__ = ["add_arguments", "run"]


def run(args: argparse.Namespace) -> int:
    return start_run(args)
