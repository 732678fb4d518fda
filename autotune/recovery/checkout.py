"""What the user's own trainers (sd-scripts, musubi-tuner) share: the Python that runs their checkout, and the
options one of their scripts accepts, read from its ``--help``. Each engine module says where to look and what
to tell the user; the looking is here once."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from sd_scripts_compat.facts.errors import UserError

OPTION = re.compile(r"(?<![\w-])--(?P<name>[A-Za-z0-9][A-Za-z0-9_]*)")  # an option named on a command line


def option_names(text: str) -> list[str]:
    """Every ``--name`` in ``text`` (a command line, a script's ``--help``), in order."""
    return [match["name"] for match in OPTION.finditer(text)]


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def choose_python(given: str | None, bases: Iterable[Path], places: tuple[str, ...], trainer: str,
                  none_found: str) -> tuple[str, str]:
    """(the Python, where it came from): ``--python``, else the first venv at ``places`` under ``bases``, else
    the Python running autotune (``none_found`` says why, e.g. "no venv beside it")."""
    if given:
        if not (os.path.isfile(given) and os.access(given, os.X_OK)):
            raise UserError(f"--python {given}: not an executable file; give the Python that runs {trainer}")
        return given, "given with --python"
    for base in bases:
        for place in places:
            candidate = base / place
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate), f"the venv in {base}"
    return sys.executable, f"{none_found}: the Python running autotune"


def read_help(python: str, script: Path, *, cwd: Path, env: Mapping[str, str], fix: str) -> tuple[str, str]:
    """``script --help``'s (stdout, stderr); a script that cannot run is one line ending in ``fix``."""
    try:
        done = subprocess.run([python, str(script), "--help"], cwd=cwd, env=dict(env), capture_output=True,
                              text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise UserError(f"{script}: could not run it with --help ({error}); check --python") from None
    if done.returncode != 0:
        raise UserError(f"{script} --help failed: {last_line(done.stderr or done.stdout)}; {fix}")
    return done.stdout, done.stderr
