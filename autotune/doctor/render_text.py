"""`autotune doctor` on the terminal: the settings line, subsets, the bucket histogram, the true steps per
epoch, then the problems grouped by kind (errors first), each line naming its file."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune.doctor.report import ERROR, DoctorReport, Problem, summary_line

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

BAR_WIDTH = 20


def settings_line(report: DoctorReport) -> str:
    s = report.settings
    family = f"family {s.family}" if s.family else "no --model: a full-size family's rules"
    return (f"for {s.resolution} px ({family}), batch {s.batch_size}; buckets in {s.bucket_reso_steps} px steps, "
            f"sides from {s.min_bucket_reso} px, no upscale; captions {s.caption_extension}; "
            f"max_token_length {s.max_token_length}" + ("; --quick: headers only, no image decoded" if s.quick else ""))


def print_report(report: DoctorReport, console: Console | None = None) -> None:
    """Print with rich (imported here: only the human view needs it)."""
    from rich.console import Console
    from rich.markup import escape

    console = console or Console(highlight=False)
    console.print(f"[bold]autotune doctor[/bold] {report.root}")
    console.print(settings_line(report), soft_wrap=True)
    console.print(_subsets_table(report))
    for line in tag_lines(report):
        console.print(escape(line), soft_wrap=True)
    console.print(_buckets_table(report))
    console.print(f"steps per epoch: [bold]{report.steps_per_epoch}[/bold] ({report.views_per_epoch} image views "
                  f"with repeats, cut per bucket into batches of {report.settings.batch_size}; the engine drops no "
                  "image: a bucket's last batch is short)", soft_wrap=True)
    for line in problem_lines(report.problems):
        console.print(line, soft_wrap=True)
    verdict = "[green]ready to train[/green]" if report.ok else "[red]fix the errors before training[/red]"
    console.print(f"{summary_line(report)}: {verdict}", soft_wrap=True)


def _subsets_table(report: DoctorReport) -> Table:
    from rich.table import Table

    table = Table(title="subsets (captions: found/missing/orphaned/empty)", title_justify="left")
    for column in ("folder", "repeats", "class tokens", "images", "usable", "captions", "modes"):
        table.add_column(column, overflow="fold")
    for s in report.subsets:
        table.add_row(s.folder, str(s.num_repeats), s.class_tokens or "-", str(s.images), str(s.usable_images),
                      f"{s.captions_found}/{s.captions_missing}/{s.captions_orphaned}/{s.captions_empty}",
                      " ".join(f"{mode}:{n}" for mode, n in s.modes))
    return table


def tag_lines(report: DoctorReport, count: int = 5) -> list[str]:
    clips = [f"videos {s.folder}: {s.clips}" for s in report.subsets if s.clips]
    return clips + [f"top tags {s.folder}: " + ", ".join(f"{tag} ({n})" for tag, n in s.top_tags[:count])
                    for s in report.subsets if s.top_tags]


def _buckets_table(report: DoctorReport) -> Table:
    from rich.table import Table

    table = Table(title=f"buckets at {report.settings.resolution} px, batch {report.settings.batch_size}",
                  title_justify="left")
    for column in ("bucket", "images", "views", "batches", "last batch", ""):
        table.add_column(column, justify="right" if column else "left")
    most = max((row.views for row in report.buckets), default=1)
    for row in report.buckets:
        bar = "#" * max(1, round(BAR_WIDTH * row.views / most))
        table.add_row(f"{row.width} x {row.height}", str(row.images), str(row.views), str(row.batches),
                      str(row.last_batch), bar)
    return table


def problem_lines(problems: tuple[Problem, ...]) -> list[str]:
    """Problems grouped by (severity, code) in report order: a heading with the shared fix, then one line per
    file. rich markup in file names and messages is escaped."""
    from rich.markup import escape

    groups: dict[tuple[str, str], list[Problem]] = {}
    for problem in problems:
        groups.setdefault((problem.severity, problem.code), []).append(problem)
    lines = []
    for (severity, code), members in groups.items():
        colour = "red" if severity == ERROR else "yellow"
        fixes = {p.fix for p in members}
        shared = f" - fix: {escape(members[0].fix)}" if len(fixes) == 1 else ""
        lines.append(f"[bold {colour}]{severity}[/bold {colour}] [bold]{code}[/bold] ({len(members)}){shared}")
        for p in members:
            fix = "" if shared else f" - fix: {escape(p.fix)}"
            lines.append(f"  {escape(p.file)}: {escape(p.message)}{fix}")
    return lines
