"""kohya-compatible LoRA training: ``python -m sd_scripts_compat.train_network --config_file config.toml``.

The same flags as sd-scripts' ``train_network.py`` (and ``sdxl_train_network.py``, which calls
``main(sdxl=True)``). This module is only the entry point: the run itself reads top to bottom in
``sd_scripts_compat.training.recipe.train``.

Extension flags (ours, command line only): ``--autotune_events_dir``, ``--save_state_every_seconds``,
``--autotune_retry_log``; see ``sd_scripts_compat.contract`` for the watchdog contract.
"""

from __future__ import annotations

import sys

from sd_scripts_compat.errors import UserError


def main(argv: list[str] | None = None, *, sdxl: bool = False) -> int:
    """Read the configuration, train, and turn bad input into one line on stderr (exit code 2)."""
    from sd_scripts_compat.config.training_config import load_training_config
    from sd_scripts_compat.quiet import silence_harmless_library_messages
    from sd_scripts_compat.training.recipe import train

    silence_harmless_library_messages()
    program = "sdxl_train_network" if sdxl else "train_network"
    try:
        config = load_training_config(sys.argv[1:] if argv is None else argv, sdxl=sdxl)
        return train(config, sdxl=sdxl)
    except UserError as error:
        print(f"{program}: error: {error}", file=sys.stderr)
        return error.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
