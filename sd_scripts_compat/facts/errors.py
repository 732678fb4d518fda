"""User-facing errors: one line that names the file and the fix, never a traceback."""

from __future__ import annotations


class UserError(Exception):
    """Bad input the user can fix (a file, a flag, a config key). Printed as one line, exit code 2."""

    exit_code = 2


def say(line: str) -> None:
    """``line`` on stderr in one write: several processes of a run (each refused alike) write to the same stream,
    and Python's stderr writes a print's text and its newline apart, so two processes' lines ran together."""
    import sys

    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def one_line(error: BaseException) -> str:
    """The error's message as the one line a user sees.

    A UserError raised in a DataLoader worker reaches the main process re-raised by torch with the worker's
    traceback folded into its message ("Caught UserError in DataLoader worker process 0. Original Traceback
    ..."); the user's line is the last one, after the class name.
    """
    text = str(error)
    if "\nOriginal Traceback" in text:
        last = text.rstrip().splitlines()[-1]
        prefix = f"{type(error).__module__}.{type(error).__qualname__}: "
        text = last[len(prefix):] if last.startswith(prefix) else last
    lines = [line for line in text.splitlines() if line.strip()]
    return " ".join(line.strip() for line in lines) if lines else type(error).__name__


class BadWeights(UserError):
    """NaN or Inf in the weights of an input file (the base model, the LoRA to start or resume from): a damaged
    file, not a divergence, so it has its own exit code (``contract.BAD_DATA_EXIT_CODE``) and is never retried."""

    exit_code = 65
