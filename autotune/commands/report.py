"""Where a run's time and memory went, and the one thing to change:

    autotune report OUTPUT_DIR            # the --out of `autotune run` (or an engine's events folder)
    autotune report OUTPUT_DIR --json
    autotune report OUTPUT_DIR --html report.html

The phase breakdown (waiting for data, copy, VAE, forward, backward, optimizer, saves, ...), GPU busy %
and peak memory per device against the card, measured it/s against the plan's prediction, spills, swapping
or throttling seen during the run, and the dominant bottleneck with its concrete fix.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from autotune.report.run_report import report_for


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("output_dir", metavar="OUTPUT_DIR", help="the --out folder of an autotune run")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--html", metavar="FILE", help="also write the report as a self-contained HTML page")


def run(args: argparse.Namespace) -> int:
    if args.html:  # said before the report is made, not after
        from autotune.own_files import refuse_foreign_page

        refuse_foreign_page(Path(args.html), "--html")
    text, _ = report_for(Path(args.output_dir), as_json=args.json, html_path=Path(args.html) if args.html else None)
    print(text, end="" if text.endswith("\n") else "\n")
    return 0
