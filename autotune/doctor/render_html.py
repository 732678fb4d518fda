"""`autotune doctor --html REPORT.html`: one self-contained page for people who would rather look than read.

An inline SVG bucket histogram, the subsets, and every problem with a thumbnail of its image as the engine
will train it (its own loader, so a 16-bit PNG shows as the white square it becomes). Nothing is linked:
CSS inline, thumbnails as base64 PNG data, so the file can be mailed or attached to an issue. Written
atomically (a crash never leaves half a page under the name).
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

from autotune.doctor.render_text import settings_line
from autotune.doctor.report import DoctorReport, summary_line
from autotune.own_files import HTML_MARK
from sd_scripts_compat.facts.dataset_scan import IMAGE_EXTENSIONS

THUMB_PX = 128
MAX_THUMBNAILS = 200  # bounds the page (~10-20 KB each) for a dataset where everything is wrong
NO_THUMBNAIL = ("empty-file", "unreadable", "corrupt", "truncated", "bomb", "mode-unsupported")  # never decoded
STYLE = """body{font-family:system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}th{background:#f3f3f3}
.error{color:#b00020;font-weight:bold}.warning{color:#a06000;font-weight:bold}img{max-width:128px;image-rendering:auto}
.ok{color:#1b7f2a}.bad{color:#b00020}code{background:#f3f3f3;padding:0 3px}"""


def _thumbnail(path: Path) -> str | None:
    """A data: URI of the engine's picture of ``path``, at most THUMB_PX on a side; None when it cannot load."""
    from sd_scripts_compat.dataset.train_dataset import load_image_rgb

    try:
        image = load_image_rgb(path)
        image.thumbnail((THUMB_PX, THUMB_PX))
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
    except Exception:  # the problem row already says why the file is broken
        return None
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def histogram_svg(report: DoctorReport) -> str:
    """Horizontal bars: one per bucket, length by views per epoch, labelled with size, images and batches."""
    row_h, label_w, bar_w = 22, 110, 360
    most = max((row.views for row in report.buckets), default=1)
    height = row_h * max(1, len(report.buckets)) + 10
    parts = [f'<svg width="{label_w + bar_w + 260}" height="{height}" '
             'role="img" aria-label="bucket histogram">']
    for i, row in enumerate(report.buckets):
        y = 5 + i * row_h
        width = max(2, round(bar_w * row.views / most))
        parts += [f'<text x="0" y="{y + 15}" font-size="13">{row.width} x {row.height}</text>',
                  f'<rect x="{label_w}" y="{y + 2}" width="{width}" height="{row_h - 6}" fill="#4a78c2"/>',
                  f'<text x="{label_w + width + 6}" y="{y + 15}" font-size="12">{row.views} views, {row.images} '
                  f'images, {row.batches} batches (last {row.last_batch})</text>']
    if not report.buckets:
        parts.append('<text x="0" y="18" font-size="13">no usable images</text>')
    parts.append("</svg>")
    return "".join(parts)


def _subsets(report: DoctorReport) -> str:
    rows = "".join(
        f"<tr><td>{html.escape(s.folder)}</td><td>{s.num_repeats}</td><td>{html.escape(s.class_tokens or '-')}</td>"
        f"<td>{s.images}</td><td>{s.usable_images}</td><td>{s.captions_found} / {s.captions_missing} / "
        f"{s.captions_orphaned} / {s.captions_empty}</td>"
        f"<td>{html.escape(', '.join(f'{m}: {n}' for m, n in s.modes))}</td>"
        f"<td>{html.escape(', '.join(f'{t} ({n})' for t, n in s.top_tags))}</td></tr>" for s in report.subsets)
    return ("<table><tr><th>folder</th><th>repeats</th><th>class tokens</th><th>images</th><th>usable</th>"
            "<th>captions found / missing / orphaned / empty</th><th>modes</th><th>top tags</th></tr>"
            f"{rows}</table>")


def _problems(report: DoctorReport) -> str:
    root = Path(report.root)
    broken = {p.file for p in report.problems if p.code in NO_THUMBNAIL}
    thumbnails: dict[str, str | None] = {}
    rows = []
    for p in report.problems:
        if (p.file not in thumbnails and p.file not in broken and len(thumbnails) < MAX_THUMBNAILS
                and Path(p.file).suffix.lower() in IMAGE_EXTENSIONS):
            thumbnails[p.file] = _thumbnail(root / p.file)
        uri = thumbnails.get(p.file)
        picture = f'<img src="{uri}" alt="{html.escape(p.file)}">' if uri else ""
        rows.append(f'<tr><td class="{p.severity}">{p.severity}</td><td><code>{html.escape(p.code)}</code></td>'
                    f"<td>{html.escape(p.file)}</td><td>{picture}</td><td>{html.escape(p.message)}</td>"
                    f"<td>{html.escape(p.fix)}</td></tr>")
    if not rows:
        return "<p class=\"ok\">no problems found</p>"
    return ("<table><tr><th>severity</th><th>problem</th><th>file</th><th>as the engine sees it</th><th>what</th>"
            f"<th>fix</th></tr>{''.join(rows)}</table>")


def report_html(report: DoctorReport) -> str:
    verdict = ('<p class="ok">ready to train</p>' if report.ok else
               f'<p class="bad">{len(report.errors)} error(s): fix them before training</p>')
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">{HTML_MARK}<title>autotune doctor: '
            f"{html.escape(report.root)}</title><style>{STYLE}</style></head><body>"
            f"<h1>autotune doctor</h1><p><code>{html.escape(report.root)}</code></p>"
            f"<p>{html.escape(settings_line(report))}</p><p>{html.escape(summary_line(report))}</p>{verdict}"
            f"<h2>buckets</h2>{histogram_svg(report)}<p>steps per epoch: <b>{report.steps_per_epoch}</b> "
            f"({report.views_per_epoch} image views with repeats, batches of {report.settings.batch_size} per "
            f"bucket)</p><h2>subsets</h2>{_subsets(report)}<h2>problems</h2>{_problems(report)}</body></html>\n")


def write_html(report: DoctorReport, path: str | Path) -> Path:
    from sd_scripts_compat.facts.atomic import write_text_atomic

    target = Path(path).expanduser()
    if not target.parent.is_dir():
        from sd_scripts_compat.facts.errors import UserError

        raise UserError(f"--html {path}: folder {target.parent} does not exist; create it or write elsewhere")
    write_text_atomic(target, report_html(report))
    return target

