"""Start-up time of the ``autotune`` CLI: median wall time of fresh processes, against ``python -c pass``.

Why: ``autotune --help`` and ``autotune probe`` must answer fast on a machine without a GPU, which holds only while
the CLI imports nothing heavy (torch, diffusers) on those paths. Each command runs as a subprocess, like a user
runs it; one warm-up run first, so the figures are warm-cache figures.

    python bench/startup.py [--runs 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

CASES: list[tuple[str, list[str]]] = [
    ("python -c pass", [sys.executable, "-c", "pass"]),
    ("autotune --help", [sys.executable, "-m", "autotune", "--help"]),
    ("autotune probe", [sys.executable, "-m", "autotune", "probe"]),
    ("autotune probe --json", [sys.executable, "-m", "autotune", "probe", "--json"]),
    ('autotune probe --gpu "RTX 3060"', [sys.executable, "-m", "autotune", "probe", "--gpu", "RTX 3060"]),
]


def time_command(command: list[str], runs: int) -> list[float]:
    """Wall seconds of ``runs`` fresh processes (after one warm-up); a failing command stops the benchmark."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    times = []
    for attempt in range(runs + 1):
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, env=env, check=False)
        elapsed = time.perf_counter() - start
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.decode()[-500:]}")
        if attempt:
            times.append(elapsed)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="timed runs per command (default 7)")
    args = parser.parse_args(argv)

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"CLI start-up, median of {args.runs} runs ({os.cpu_count()} CPUs, Python "
                        f"{sys.version.split()[0]})", title_justify="left")
    for column in ("command", "median s", "min s", "max s", "over python -c pass"):
        table.add_column(column, justify="left" if column == "command" else "right")
    baseline = None
    for label, command in CASES:
        times = time_command(command, args.runs)
        median = statistics.median(times)
        baseline = median if baseline is None else baseline
        extra = "" if median is baseline else f"+{median - baseline:.3f} s"
        table.add_row(label, f"{median:.3f}", f"{min(times):.3f}", f"{max(times):.3f}", extra)
    Console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
