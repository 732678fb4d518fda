"""kohya-compatible LoRA training: ``python -m sd_scripts_compat.train_network --config_file config.toml``.

The same flags as sd-scripts' ``train_network.py`` (and ``sdxl_train_network.py`` / ``flux_train_network.py``,
which call ``main(sdxl=True)`` / ``main(script="flux_train_network")``). This module is only the entry
point: the run itself reads top to bottom in
``sd_scripts_compat.training.recipe.train``.

Extension flags (ours, command line only): ``--autotune_events_dir``, ``--autotune_state_dir``,
``--save_state_every_seconds``, ``--autotune_retry_log``, ``--autotune_monitor_seconds``; see
``sd_scripts_compat.facts.contract`` for the watchdog contract.
"""

from __future__ import annotations

import sys

from sd_scripts_compat.facts.errors import UserError, one_line, say


def main(argv: list[str] | None = None, *, sdxl: bool = False, script: str | None = None) -> int:
    """Read the configuration, train, and turn bad input into one line on stderr (exit code 2).

    A full disk anywhere (a save, a cache, an event) is one line too, with its own exit code
    (``contract.DISK_FULL_EXIT_CODE``), so the watchdog neither retries it nor calls it a crash. SIGINT and
    SIGTERM are handled from the first line on (``training.stopping``): before the training loop they stop
    at once with one line (nothing to save), in it at the next step boundary with the state saved.
    """
    from sd_scripts_compat.facts.contract import DISK_FULL_EXIT_CODE, is_disk_full_error
    from sd_scripts_compat.facts.kohya_args import script_name
    from sd_scripts_compat.training.stopping import StopSignals

    program = script_name(sdxl=sdxl, script=script)
    with StopSignals.installed() as stops:
        try:
            from sd_scripts_compat.config.training_config import load_training_config
            from sd_scripts_compat.quiet import our_warnings_as_lines, silence_harmless_library_messages
            from sd_scripts_compat.training.recipe import train

            silence_harmless_library_messages()
            our_warnings_as_lines(program)
            config = load_training_config(sys.argv[1:] if argv is None else argv, script=program)
            return train(config, sdxl=config.sdxl)
        except UserError as error:
            say(f"{program}: error: {one_line(error)}")
            return error.exit_code
        except KeyboardInterrupt:  # a stop signal while reading the configuration or importing
            say(f"{program}: {stops.name} before training started; nothing to save")
            return stops.exit_code
        except Exception as error:
            if not is_disk_full_error(error):
                raise
            where = getattr(error, "filename", None)
            say(f"{program}: error: disk full{f' writing {where}' if where else ''} ({one_line(error)}); "
                "free some space or choose another output_dir")
            return DISK_FULL_EXIT_CODE


if __name__ == "__main__":
    raise SystemExit(main())
