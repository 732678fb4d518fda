"""Interactive setup: probe the machine, choose a base model and a dataset, see the plan that fits the GPU
(each choice with its reason, the predicted peak VRAM, it/s and time), change any value and see it predicted
again, then write config.toml + dataset.toml, print the sd-scripts / lora-scripts command, and start
`autotune run` if you like.

Every question has a flag; `--yes` takes the default of every question not answered by one. Without a
terminal it needs `--yes` (or use `autotune plan`). Ctrl-C at any question exits 130 and writes nothing.

    autotune wizard
    autotune wizard examples/dataset --model builtin:tiny-sd15 --yes
    autotune wizard photos/ --model sd15.safetensors --gpu "RTX 3060" --rank 64 --out configs/me --yes
"""

from __future__ import annotations

import argparse
import sys

from autotune.launch.arg_types import finite, optimizer_name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from autotune.planning.planner import GOALS, PRIORITIES
    from autotune.planning.request import EXPERTS
    from sd_scripts_compat.facts.optimizers import optimizer_names

    parser.add_argument("dataset", nargs="?", default=None, metavar="DATASET",
                        help="folder of N_name image subfolders, or a flat folder of images")
    parser.add_argument("-y", "--yes", action="store_true", help="take the default of every question not given "
                        "by a flag (no terminal needed)")
    hardware = parser.add_argument_group("hardware")
    hardware.add_argument("--gpu", metavar="NAME", help="plan for this catalogue card (configs for another machine)")
    hardware.add_argument("--gpu-index", type=int, metavar="N", help="with several GPUs: the one that trains")
    hardware.add_argument("--vram", type=finite, metavar="GB", help="plan as if the card had only this much memory")
    hardware.add_argument("--cpu", action="store_true", help="no GPU here: plan for this machine's CPU")
    hardware.add_argument("--probe", metavar="FILE", help="plan for the machine `autotune probe --json` saved")
    model = parser.add_argument_group("base model")
    model.add_argument("--model", metavar="PATH|builtin:ID", help="a .safetensors / .ckpt file, a diffusers "
                       "folder, or builtin:tiny-sd15 / builtin:sd15 / builtin:sdxl ...")
    model.add_argument("--family", help="the family when it cannot be told (e.g. sd2-v for a 768-v SD2 file)")
    model.add_argument("--experts", choices=EXPERTS,
                       help="Wan 2.2 A14B: the low-noise expert alone (default) or both in one run")
    model.add_argument("--allow-pickle", action="store_true", help="allow a .ckpt/.pt pickle (weights_only load)")
    data = parser.add_argument_group("dataset (a flat folder of images)")
    data.add_argument("--organise", "--organize", choices=("link", "copy", "no"),
                      help="make an N_name folder from a flat one by linking or copying (never moving) the images")
    data.add_argument("--frames", type=int, help="a video family's clip length, 1 + 4k frames (default 1: images)")
    data.add_argument("--repeats", type=int, help="repeats per epoch for the N_name folder (default 10)")
    data.add_argument("--trigger", help="trigger word / class tokens for the N_name folder (default: folder name)")
    data.add_argument("--organise-into", "--organize-into", metavar="DIR",
                      help="the new dataset folder (default: next to the flat one, -kohya)")
    goal = parser.add_argument_group("goal and output")
    goal.add_argument("--goal", choices=GOALS, help="what the LoRA learns (default character)")
    goal.add_argument("--priority", choices=PRIORITIES, help="speed | balanced | quality (default balanced)")
    goal.add_argument("--output-name", help="the LoRA file's name (default: <dataset>-<family>)")
    goal.add_argument("--out", metavar="DIR", help="folder for config.toml + dataset.toml (default output/<name>)")
    goal.add_argument("--format", choices=("kohya", "lora-scripts"), help="config layout (default kohya)")
    values = parser.add_argument_group("plan values (each re-predicted; one that does not fit is refused)")
    values.add_argument("--batch", "--batch-size", "--train_batch_size", dest="batch_size", type=int,
                        help="micro-batch (train_batch_size), as `autotune plan` / `run` take it")
    values.add_argument("--accum", "--grad-accum", "--gradient_accumulation_steps", dest="grad_accum", type=int,
                        help="gradient_accumulation_steps")
    values.add_argument("--rank", type=int, help="LoRA rank (network_dim)")
    values.add_argument("--resolution", type=int, help="training resolution in px")
    values.add_argument("--epochs", type=int, help="max_train_epochs")
    values.add_argument("--optimizer", "--optimizer_type", type=optimizer_name, choices=optimizer_names(),
                        metavar="NAME", help=f"optimizer_type: {', '.join(optimizer_names())}")
    values.add_argument("--precision", choices=("bf16", "fp16", "no"), help="mixed_precision")
    values.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                        help="gradient checkpointing on / off")
    values.add_argument("--train-text-encoder", action=argparse.BooleanOptionalAction, default=None,
                        help="train the text encoder LoRA too / UNet only")
    parser.add_argument("--accept", action="store_true",
                        help="accept the plan (with the values above) instead of asking; one that does not fit "
                        "is an error")
    parser.add_argument("--start", action=argparse.BooleanOptionalAction, default=None,
                        help="start `autotune run` at the end (default: ask; with --yes: start)")


def run(args: argparse.Namespace) -> int:
    from sd_scripts_compat.facts.errors import UserError

    if not args.yes and not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise UserError("no terminal to ask on: use `autotune plan DATASET --model M --out DIR` for configs, "
                        "or `autotune wizard --yes` with flags for the answers")
    from autotune.wizard.flow import run_wizard

    return run_wizard(args)
