"""The report as text (rich tables, plain when not on a terminal) and as JSON."""

from __future__ import annotations

import io
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.table import Table

GIB = 2**30
PHASE_LABELS = {
    "setup": "setup (load, build)", "caching": "caching (latents, text)", "data": "waiting for data",
    "to_device": "host-to-device copy", "vae_encode": "VAE encode", "forward": "forward", "backward": "backward",
    "optimizer": "optimizer step", "validation": "validation", "save": "saving", "sample": "sample images",
    "other": "other (uncovered)",
}


def render_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2, sort_keys=True, default=str)


def render_text(report: dict[str, Any], width: int = 100) -> str:
    """The phase table, the device table, speed and memory lines, warnings, and the bottleneck."""
    from rich.console import Console

    console = Console(file=io.StringIO(), width=width, record=True, color_system=None, highlight=False)
    console.print(f"run report: {report['output_dir']} ({report['outcome']}, {report['steps']} steps"
                  f"{', family ' + report['family'] if report.get('family') else ''})")
    table = report["phases"]
    if table is not None:
        console.print(f"where the time went: {table['wall_seconds']:.1f} s wall, {table['sampled_steps']} of "
                      f"{table['steps']} steps timed phase by phase ({table['method']}), scaled to all steps")
        console.print(_phase_table(table))
    if report["devices"]:
        console.print("devices while training:")
        console.print(_device_table(report["devices"]))
    for line in _summary_lines(report):
        console.print(line)
    for finding in report["findings"]:
        console.print(f"warning: {finding['message']}; {finding['fix']}")
    if report.get("resumed_changed"):
        console.print(f"resumed although its inputs changed (--resume-changed): {'; '.join(report['resumed_changed'])}")
    neck = report["bottleneck"]
    console.print(f"bottleneck: {neck['message']}: {neck['fix']}")
    return console.export_text()


def _phase_table(table: dict[str, Any]) -> Table:
    from rich.table import Table

    out = Table()
    out.add_column("phase")
    out.add_column("seconds", justify="right")
    out.add_column("% of wall", justify="right")
    out.add_column("% of steps", justify="right")
    for name, seconds in table["seconds"].items():
        step_share = table["of_steps"].get(name)
        out.add_row(PHASE_LABELS.get(name, name), f"{seconds:.2f}", f"{100 * table['of_wall'][name]:.1f}",
                    f"{100 * step_share:.1f}" if step_share is not None else "")
    out.add_row("total", f"{sum(table['seconds'].values()):.2f}", "100.0", "")
    return out


def _device_table(devices: list[dict[str, Any]]) -> Table:
    from rich.table import Table

    out = Table()
    for column in ("device", "name", "busy %", "peak used", "total", "SM clock"):
        out.add_column(column, justify="left" if column in ("device", "name") else "right")
    for row in devices:
        clock = f"{row['sm_clock_mhz']:.0f} / {row['max_sm_clock_mhz']} MHz" if row.get("sm_clock_mhz") and \
            row.get("max_sm_clock_mhz") else ""
        out.add_row(row["device"], row.get("name") or "", _number(row.get("busy_percent"), "{:.0f}"),
                    _gib(row.get("peak_used_bytes")), _gib(row.get("total_bytes")), clock)
    return out


def _summary_lines(report: dict[str, Any]) -> list[str]:
    lines = []
    speed = report["speed"]
    if speed["measured_it_per_s"]:
        line = f"speed: {speed['measured_it_per_s']:.2f} it/s measured"
        if speed["predicted_it_per_s"]:
            line += f", {speed['predicted_it_per_s']:.2f} predicted by the plan " \
                    f"({speed['measured_over_predicted']:.2f}x the prediction)"
        lines.append(line)
    mem = report["memory"]
    if mem["peak_bytes"] and mem["kind"] == "emulated_card":
        lines.append(f"peak memory: {mem['peak_bytes'] / 2**20:.1f} MiB of tensors on the emulated card of "
                     f"{mem['total_bytes'] / 2**20:g} MiB")
    elif mem["peak_bytes"]:
        what = "CUDA reserved" if mem["kind"] == "cuda_max_reserved" else "process RSS"
        of = f" of {_gib(mem['total_bytes'])} {'on the card' if mem['kind'] == 'cuda_max_reserved' else 'RAM'}" \
            if mem["total_bytes"] else ""
        lines.append(f"peak memory: {_gib(mem['peak_bytes'])} {what}{of}")
    if mem.get("process_peak_bytes"):
        lines.append("peak memory per process: " + ", ".join(
            f"{rank}: {_gib(peak)}" for rank, peak in enumerate(mem["process_peak_bytes"])))
    if report.get("communication"):
        lines.append(_communication_line(report["communication"]))
    if report["phases"] is not None:
        lines.append(f"phases cover {100 * report['phases']['covered_fraction']:.1f}% of the wall time")
    return lines


def _communication_line(comm: dict[str, Any]) -> str:
    """Each process's collectives in its profiled step, and their share of the run's seconds per step."""
    where = "NCCL's kernels, overlapping the compute" if comm["method"] == "nccl_kernels" else "gloo"
    each = []
    for rank, row in enumerate(comm["per_process"]):
        share = f" ({100 * row['share']:.0f}% of a step)" if row and row["share"] is not None else ""
        each.append(f"{rank}: {row['seconds']:.3f} s{share}" if row else f"{rank}: not profiled")
    return f"communication (one profiled step, {where}): " + ", ".join(each)


def _gib(value: float | None) -> str:
    return f"{value / GIB:.2f} GiB" if value else ""


def _number(value: float | None, form: str) -> str:
    return form.format(value) if value is not None else ""
