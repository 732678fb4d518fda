"""The report as one self-contained HTML page: inline SVG charts (step time, busy %, memory over the run) and
the phase bar, no scripts, no external assets. Hand-drawn SVG because a chart library would be a new
dependency for three line charts."""

from __future__ import annotations

from html import escape
from typing import Any

from autotune.own_files import HTML_MARK
from autotune.report.load import RunFiles
from autotune.report.render import PHASE_LABELS

GIB = 2**30
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf", "#393b79", "#aaaaaa")
WIDTH, HEIGHT, PAD = 720, 220, 48


def render_html(report: dict[str, Any], run: RunFiles) -> str:
    """The page: the bottleneck, warnings, the phase bar and table, the devices, then the charts."""
    neck = report["bottleneck"]
    parts = [f"<h1>Run report</h1><p>{escape(report['output_dir'])}: {escape(str(report['outcome']))}, "
             f"{escape(str(report['steps']))} steps</p>",
             f"<p class='neck'><b>Bottleneck:</b> {escape(neck['message'])}: {escape(neck['fix'])}</p>"]
    parts += [f"<p class='warn'>warning: {escape(f['message'])}; {escape(f['fix'])}</p>" for f in report["findings"]]
    if report["phases"] is not None:
        parts += [phase_bar(report["phases"]), _phase_rows(report["phases"])]
    parts.append(_device_rows(report["devices"]))
    parts += _charts(run)
    body = "\n".join(parts)
    return ("<!doctype html><html><head><meta charset='utf-8'>" + HTML_MARK
            + "<title>autotune run report</title><style>"
            "body{font-family:sans-serif;max-width:760px;margin:2em auto;color:#222}"
            "table{border-collapse:collapse;margin:1em 0}td,th{padding:2px 10px;border-bottom:1px solid #ddd;"
            "text-align:right}td:first-child,th:first-child{text-align:left}.neck{background:#eef;padding:8px}"
            ".warn{background:#fee;padding:8px}svg{display:block;margin:1em 0}"
            f"</style></head><body>\n{body}\n</body></html>\n")


def phase_bar(table: dict[str, Any]) -> str:
    """The wall time as one stacked bar, one colour per phase, with a legend."""
    x, rects, legend = 0.0, [], []
    for i, (name, share) in enumerate(table["of_wall"].items()):
        color = COLORS[i % len(COLORS)]
        width = share * WIDTH
        if width > 0:
            rects.append(f"<rect x='{x:.1f}' y='0' width='{width:.1f}' height='28' fill='{color}'>"
                         f"<title>{escape(PHASE_LABELS.get(name, name))}: {100 * share:.1f}%</title></rect>")
        x += width
        legend.append(f"<span style='color:{color}'>&#9632;</span> {escape(PHASE_LABELS.get(name, name))} "
                      f"{100 * share:.1f}%")
    return (f"<h2>Where the time went ({table['wall_seconds']:.1f} s)</h2><svg xmlns='http://www.w3.org/2000/svg' "
            f"width='{WIDTH}' height='28'>{''.join(rects)}</svg><p>{' &nbsp; '.join(legend)}</p>")


def line_chart(title: str, series: list[tuple[str, list[tuple[float, float]]]], x_label: str, y_label: str,
               y_max: float | None = None) -> str:
    """An SVG line chart of ``series`` (label, points), axes scaled to the data (y from 0)."""
    points = [p for _, pts in series for p in pts]
    if not points:
        return ""
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    top = y_max or max(p[1] for p in points) or 1.0
    span = (x1 - x0) or 1.0

    def xy(point: tuple[float, float]) -> str:
        px = PAD + (point[0] - x0) / span * (WIDTH - 2 * PAD)
        py = HEIGHT - PAD + 20 - min(point[1], top) / top * (HEIGHT - PAD)
        return f"{px:.1f},{py:.1f}"

    lines, legend = [], []
    for i, (label, pts) in enumerate(series):
        color = COLORS[i % len(COLORS)]
        lines.append(f"<polyline fill='none' stroke='{color}' stroke-width='1.5' points='{' '.join(map(xy, pts))}'/>")
        legend.append(f"<text x='{PAD + 8 + 200 * i}' y='14' fill='{color}' font-size='12'>{escape(label)}</text>")
    base = HEIGHT - PAD + 20
    axes = (f"<line x1='{PAD}' y1='{base}' x2='{WIDTH - PAD}' y2='{base}' stroke='#888'/>"
            f"<line x1='{PAD}' y1='20' x2='{PAD}' y2='{base}' stroke='#888'/>"
            f"<text x='4' y='28' font-size='11'>{top:.3g}</text><text x='4' y='{base}' font-size='11'>0</text>"
            f"<text x='{PAD}' y='{base + 16}' font-size='11'>{x0:.0f}</text>"
            f"<text x='{WIDTH - PAD - 30}' y='{base + 16}' font-size='11'>{x1:.0f}</text>"
            f"<text x='{WIDTH / 2 - 40}' y='{base + 16}' font-size='11'>{escape(x_label)}</text>"
            f"<text x='4' y='{HEIGHT / 2}' font-size='11'>{escape(y_label)}</text>")
    return (f"<h2>{escape(title)}</h2><svg xmlns='http://www.w3.org/2000/svg' width='{WIDTH}' "
            f"height='{HEIGHT + 20}'>{axes}{''.join(lines)}{''.join(legend)}</svg>")


def _charts(run: RunFiles) -> list[str]:
    step_seconds = (run.done or {}).get("step_seconds") or []  # the steady-state steps, after the warm-up ones
    steps = [(float(i + 1), s) for i, s in enumerate(step_seconds)]
    t0 = run.samples[0]["t"] if run.samples else 0.0
    busy, memory = _gpu_series(run.samples, t0) or _cpu_series(run.samples, t0)
    return [line_chart("Step time", [("seconds per step", steps)], "timed step", "s"),
            line_chart("Busy over the run", busy, "seconds", "%", y_max=100.0),
            line_chart("Memory over the run", memory, "seconds", "GiB")]


def _gpu_series(samples: list[dict[str, Any]], t0: float) -> tuple[list[Any], list[Any]] | None:
    busy: dict[int, list[tuple[float, float]]] = {}
    used: dict[int, list[tuple[float, float]]] = {}
    totals: dict[int, float] = {}
    for sample in samples:
        for gpu in sample.get("gpus") or []:
            t = sample["t"] - t0
            if gpu.get("util_percent") is not None:
                busy.setdefault(gpu["index"], []).append((t, gpu["util_percent"]))
            if gpu.get("mem_used_bytes") is not None:
                used.setdefault(gpu["index"], []).append((t, gpu["mem_used_bytes"] / GIB))
                totals[gpu["index"]] = (gpu.get("mem_total_bytes") or 0) / GIB
    if not busy and not used:
        return None
    memory = [(f"GPU {i} used", pts) for i, pts in sorted(used.items())]
    memory += [(f"GPU {i} total", [(pts[0][0], totals[i]), (pts[-1][0], totals[i])]) for i, pts in sorted(used.items())]
    return [(f"GPU {i} busy", pts) for i, pts in sorted(busy.items())], memory


def _cpu_series(samples: list[dict[str, Any]], t0: float) -> tuple[list[Any], list[Any]]:
    import os

    cores = os.cpu_count() or 1
    cpu = [(s["t"] - t0, (s["proc"].get("cpu_percent") or 0) / cores) for s in samples if s.get("proc")]
    rss = [(s["t"] - t0, (s["proc"].get("rss_bytes") or 0) / GIB) for s in samples if s.get("proc")]
    return [("process CPU (all cores)", cpu)], [("process RSS", rss)]


def _phase_rows(table: dict[str, Any]) -> str:
    rows = "".join(f"<tr><td>{escape(PHASE_LABELS.get(k, k))}</td><td>{v:.2f}</td><td>{100 * table['of_wall'][k]:.1f}"
                   f"</td></tr>" for k, v in table["seconds"].items())
    return f"<table><tr><th>phase</th><th>seconds</th><th>% of wall</th></tr>{rows}</table>"


def _device_rows(devices: list[dict[str, Any]]) -> str:
    if not devices:
        return ""
    rows = "".join(f"<tr><td>{escape(d['device'])}</td><td>{escape(d.get('name') or '')}</td>"
                   f"<td>{_percent(d.get('busy_percent'))}</td><td>{(d.get('peak_used_bytes') or 0) / GIB:.2f}</td>"
                   f"<td>{(d.get('total_bytes') or 0) / GIB:.2f}</td></tr>" for d in devices)
    return ("<h2>Devices while training</h2><table><tr><th>device</th><th>name</th><th>busy %</th>"
            f"<th>peak GiB</th><th>total GiB</th></tr>{rows}</table>")


def _percent(value: float | None) -> str:
    return "" if value is None else f"{value:.0f}"
