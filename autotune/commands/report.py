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

REPORT_HTML = "autotune_report.html"  # what `autotune run` writes into its output folder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("output_dir", metavar="OUTPUT_DIR", help="the --out folder of an autotune run")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--html", metavar="FILE", help="also write the report as a self-contained HTML page")


def run(args: argparse.Namespace) -> int:
    text, _ = report_for(Path(args.output_dir), as_json=args.json, html_path=Path(args.html) if args.html else None)
    print(text, end="" if text.endswith("\n") else "\n")
    return 0


def report_for(folder: Path, *, as_json: bool = False, html_path: Path | None = None) -> tuple[str, dict]:
    """The rendered report of the run in ``folder`` (and its HTML page written to ``html_path``)."""
    from autotune.report.analysis import build_report
    from autotune.report.load import load_run
    from autotune.report.render import render_json, render_text

    files = load_run(folder)
    report = build_report(files)
    if html_path is not None:
        from autotune.report.html import render_html
        from sd_scripts_compat.atomic import write_text_atomic
        from sd_scripts_compat.errors import UserError

        try:
            write_text_atomic(html_path, render_html(report, files))
        except OSError as error:
            raise UserError(f"--html {html_path}: cannot write there ({error.strerror or error}); "
                            "choose a writable path") from None
    return (render_json(report) if as_json else render_text(report)), report
