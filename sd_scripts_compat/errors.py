"""User-facing errors: one line that names the file and the fix, never a traceback."""

from __future__ import annotations


class UserError(Exception):
    """Bad input the user can fix (a file, a flag, a config key). Printed as one line, exit code 2."""

    exit_code = 2
