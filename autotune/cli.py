"""The ``autotune`` command line.

Each subcommand lives in ``autotune/commands/<name>.py`` with ``add_arguments(parser)`` and
``run(args) -> int``. Those modules import nothing heavy at module level (torch, diffusers load in
``run``), so ``autotune --help`` and ``autotune probe`` answer fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import NoReturn

from autotune import __version__

# (name, module, one-line help). A subcommand is listed here only once it exists.
COMMANDS: list[tuple[str, str, str]] = [
    ("probe", "autotune.commands.probe", "show the GPU(s), CPU, RAM, disk and ML libraries of this machine"),
    ("inspect", "autotune.commands.inspect", "show a LoRA file's family, modules, ranks, precision and metadata"),
    ("plan", "autotune.commands.plan", "plan LoRA settings that fit a GPU (fastest predicted), write kohya configs"),
    ("doctor", "autotune.commands.doctor", "check a dataset before training: images, captions, buckets, steps"),
    ("wizard", "autotune.commands.wizard", "interactive setup: questions, a plan that fits, configs or a training"),
    ("run", "autotune.commands.run", "train a LoRA under the OOM watchdog: plan, run, step down and resume"),
    ("train", "autotune.commands.train", "train with a kohya config.toml (sd-scripts' train_network flags)"),
    ("bench", "autotune.commands.bench", "measure it/s, images/s and peak memory with short real runs (a sweep)"),
    ("report", "autotune.commands.report", "where a run's time and memory went, and its bottleneck with the fix"),
    ("ui", "autotune.commands.ui", "the planner, doctor, runs and reports in the browser (a local web app)"),
]


EXAMPLES = """examples:
  autotune run examples/dataset --model builtin:tiny-sd15      # train the built-in tiny model here
  autotune plan DATASET --model sdxl.safetensors --gpu "RTX 4070" --out cfg
  autotune plan DATASET --model builtin:flux-dev --vram 16
  autotune doctor DATASET
  autotune run DATASET --model sd15.safetensors --out runs/mine
  autotune report runs/mine
  autotune inspect LORA.safetensors                             # any kohya LoRA file
each command has its own --help"""


def _description() -> str:
    """The families come from their data (``sd_scripts_compat.facts.families``), so a new one is named here too."""
    from sd_scripts_compat.facts.families import family_names, get_family

    names = [name for name in family_names() if not get_family(name).tiny]
    kinds = dict.fromkeys(get_family(name).description.split(" (")[0] for name in names)
    return (f"Plan, run and recover LoRA training on the GPU you have: {', '.join(kinds)}.\n"
            f"Built-in models (--model builtin:NAME): {', '.join(family_names())}.")


class OneLineParser(argparse.ArgumentParser):
    """argparse with its errors as one line (``autotune plan: error: ...; see autotune plan --help``): the usage
    block it prints first would bury the line that says what is wrong."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported (``autotune --help`` imports none of them)."""
    parser = OneLineParser(
        prog="autotune", description=_description(), epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"lora-autotune {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    for name, module_name, help_text in COMMANDS:
        if name != command:
            subparsers.add_parser(name, help=help_text, description=help_text)
            continue
        module = importlib.import_module(module_name)
        sub = subparsers.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip(),
                                    formatter_class=argparse.RawDescriptionHelpFormatter)  # examples: one a line
        module.add_arguments(sub)
        sub.set_defaults(_run=module.run)
    return parser


def _command_in(argv: list[str]) -> str | None:
    """The subcommand: the first word that is not an option (the top level takes no other words)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    from sd_scripts_compat.facts.errors import UserError, one_line

    argv = sys.argv[1:] if argv is None else argv
    try:
        parser = build_parser(_command_in(argv))  # reads the family files: one of SD_COMPAT_FAMILY_PATH may be bad
    except UserError as error:
        print(f"autotune: error: {one_line(error)}", file=sys.stderr)
        return error.exit_code
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 0
    from sd_scripts_compat.quiet import our_warnings_as_lines, silence_harmless_library_messages

    silence_harmless_library_messages()  # plan and bench import lycoris / bitsandbytes, which log at import
    our_warnings_as_lines(f"autotune {args.command}", also=(os.path.dirname(os.path.abspath(__file__)),))
    try:
        return int(args._run(args) or 0)
    except UserError as error:
        print(f"autotune {args.command}: error: {one_line(error)}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print(f"autotune {args.command}: interrupted", file=sys.stderr)
        return 130
    except OSError as error:  # a full disk under one of our own writes (configs, logs, reports)
        from sd_scripts_compat.facts.contract import DISK_FULL_EXIT_CODE, is_disk_full_error

        if not is_disk_full_error(error):
            raise
        where = f" writing {error.filename}" if error.filename else ""
        print(f"autotune {args.command}: error: disk full{where} ({error.strerror}); free some space there or "
              "write elsewhere", file=sys.stderr)
        return DISK_FULL_EXIT_CODE


if __name__ == "__main__":
    raise SystemExit(main())
