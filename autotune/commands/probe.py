"""Show this machine's GPU(s), CPU, RAM, free disk and ML libraries, or what the tools assume for a named GPU.

Without a GPU, driver or NVML this still answers (with the reason no CUDA GPU was found). `--json` prints one
object whose fields are documented in autotune/hardware/probe.py; `--gpu "RTX 3060"` shows the catalogue's figures for a
card that is not in this machine.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--gpu", metavar="NAME",
                        help='assume this catalogue card instead of probing the GPU (e.g. "RTX 3060", "4060 Ti 16GB")')
    parser.add_argument("--output-dir", default=".", metavar="DIR",
                        help="folder training output will go to; its free disk space is reported (default: .)")


def run(args: argparse.Namespace) -> int:
    from autotune.hardware.probe import probe_system, render

    probe = probe_system(output_dir=args.output_dir, assume_gpu=args.gpu)
    if args.json:
        print(probe.to_json())
    else:
        render(probe)
    return 0
