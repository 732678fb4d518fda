"""One run's report from its folder: text or JSON, and the HTML page (``autotune report``, ``autotune run``)."""

from __future__ import annotations

from pathlib import Path


def report_for(folder: Path, *, as_json: bool = False, html_path: Path | None = None) -> tuple[str, dict]:
    """The rendered report of the run in ``folder`` (and its HTML page written to ``html_path``)."""
    from autotune.report.analysis import build_report
    from autotune.report.load import load_run
    from autotune.report.render import render_json, render_text

    files = load_run(folder)
    report = build_report(files)
    if html_path is not None:
        from autotune.report.html import render_html
        from sd_scripts_compat.facts.atomic import write_text_atomic
        from sd_scripts_compat.facts.errors import UserError

        try:
            write_text_atomic(html_path, render_html(report, files))
        except OSError as error:
            raise UserError(f"--html {html_path}: cannot write there ({error.strerror or error}); "
                            "choose a writable path") from None
    return (render_json(report) if as_json else render_text(report)), report
