"""A run the web app started, in a process of its own: its validated request run through ``autotune run``'s own
function, with no command line made from what the page sent.

The server spawns ``python -m autotune.ui.start_run RECORD OUT [--resume]``: RECORD is the run's
``RUNS/.autotune-ui/RUN.json`` (the values the server validated, and the engine it offers under the name the page
chose), OUT the run's folder; both are the server's own paths. The values are validated again by the same schema
(a file is read, so it is checked), made the namespace ``autotune run``'s parser would produce, and given to
``launch.run.start_run``, the function ``autotune run`` and the wizard start runs with: the same watchdog; a
refusal is the same one line and exit code.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from pydantic import ValidationError

    from autotune.ui.runs import Record
    from autotune.ui.schemas import BadBody, command_schema, given

    words = sys.argv[1:] if argv is None else argv
    if len(words) not in (2, 3) or words[2:] not in ([], ["--resume"]):
        print("autotune ui: error: start_run takes RECORD OUT [--resume] (the server starts it)", file=sys.stderr)
        return 2
    record_path, out = Path(words[0]), words[1]
    try:
        record = Record.model_validate_json(record_path.read_bytes())
        schema = command_schema("run")
        args = schema.namespace(given(schema.validate(record.values or {})))
    except (OSError, ValidationError, BadBody) as error:
        print(f"autotune run: error: {record_path}: not a run the server recorded ({str(error)[:200]})",
              file=sys.stderr)
        return 2
    args.out, args.resume = out, "--resume" in words
    if record.engine is not None:  # the server's own engine options, never the page's
        args.engine, args.python = record.engine.engine, record.engine.python
    return start(args)


def start(args: argparse.Namespace) -> int:
    """``launch.run.start_run`` with ``autotune run``'s refusals: one line on stderr and the error's exit code."""
    from autotune.launch.run import start_run
    from sd_scripts_compat.facts.errors import UserError, one_line
    from sd_scripts_compat.quiet import silence_harmless_library_messages

    silence_harmless_library_messages()
    try:
        return int(start_run(args) or 0)
    except UserError as error:
        print(f"autotune run: error: {one_line(error)}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print("autotune run: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
