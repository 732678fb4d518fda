"""What a run writes into ``output_dir``: LoRA files and state folders, named as sd-scripts names them,
and the pruning of old ones that ``save_last_n_*`` asks for.

Names: ``{name}.safetensors`` (final), ``{name}-{epoch:06d}`` / ``{name}-step{N:08d}`` (intermediate,
``.safetensors`` and, with ``save_state``, ``-state``), ``{name}-state`` (the rolling state the
watchdog, Ctrl-C and ``save_state_every_seconds`` write).

Pruning follows sd-scripts: ``save_last_n_epochs`` keeps the newest N epoch files; ``save_last_n_steps``
keeps the files of the last N *steps* (a file of step s stays while s > current step - N). State folders
are pruned the same way by ``save_last_n_epochs_state`` / ``save_last_n_steps_state``, which default to
``save_last_n_epochs`` / ``save_last_n_steps``, so LoRA files and states can be kept for different spans.
"""

from __future__ import annotations

import glob
import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sd_scripts_compat.facts.errors import UserError

if TYPE_CHECKING:
    from sd_scripts_compat.config.training_config import TrainingConfig
    from sd_scripts_compat.training.train_state import TrainCounters


@dataclass(frozen=True)
class RunPaths:
    output_dir: Path
    output_name: str
    events_dir: Path | None
    states_root: Path  # where state folders go: output_dir, as in sd-scripts, unless --autotune_state_dir

    @classmethod
    def create(cls, config: TrainingConfig) -> RunPaths:
        """The run's paths from ``output_dir`` / ``output_name``; the output folders exist and are writable."""
        output_dir = Path(config.output_dir or "output")
        paths = cls(output_dir, safe_output_name(config.output_name or "last"),
                    Path(config.autotune_events_dir) if config.autotune_events_dir else None,
                    Path(config.autotune_state_dir) if config.autotune_state_dir else output_dir)
        check_output_dir(paths.output_dir)
        check_output_dir(paths.states_root)
        return paths

    def lora_file(self, suffix: str = "") -> Path:
        return self.output_dir / f"{self.output_name}{suffix}.safetensors"

    def state_dir(self, suffix: str = "") -> Path:
        """The rolling state folder (kohya's ``{output_name}-state``), or an intermediate one with ``suffix``."""
        return self.states_root / f"{self.output_name}{suffix}-state"


def safe_output_name(name: str) -> str:
    """Every file we write is ``output_dir / (output_name + suffix)``: the name must not lead elsewhere."""
    if not name or name in (".", "..") or Path(name).name != name or "\\" in name or "\0" in name:
        raise UserError(f"output_name = {name!r}: must be a plain file name (no folders); "
                        "put the folder in output_dir")
    return name


def check_output_dir(output_dir: Path) -> None:
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"{output_dir}: cannot create the output folder ({error.strerror}); "
                        "choose another output_dir") from None
    if not os.access(output_dir, os.W_OK):
        raise UserError(f"{output_dir}: output folder is not writable; choose another output_dir")


@dataclass(frozen=True)
class SavePolicy:
    """Which intermediate saves a run keeps (None: all of them)."""

    save_state: bool
    keep_epoch_files: int | None
    keep_step_files: int | None
    keep_epoch_states: int | None
    keep_step_states: int | None

    @classmethod
    def from_config(cls, config: TrainingConfig) -> SavePolicy:
        return cls(save_state=bool(config.save_state),
                   keep_epoch_files=config.save_last_n_epochs, keep_step_files=config.save_last_n_steps,
                   keep_epoch_states=config.save_last_n_epochs_state or config.save_last_n_epochs,
                   keep_step_states=config.save_last_n_steps_state or config.save_last_n_steps)


@dataclass(frozen=True)
class Checkpointer:
    """Writes this run's LoRA files and state folders (main process only) and prunes old ones.

    ``facts`` holds the run's metadata; the per-file fields (name, epoch, steps, finish time) are
    filled in at each save. ``guard`` (a ``training.stability.StabilityGuard``) is asked before every
    save and raises instead of letting non-finite or diverged weights be written.
    """

    paths: RunPaths
    policy: SavePolicy
    network: Any
    optimizer: Any  # the torch optimizer (unwrapped)
    lr_scheduler: Any
    settings: dict[str, Any]
    micro_batch: int
    facts: Any  # network.lora_file.TrainingFacts
    family: Any
    save_dtype: Any
    is_main_process: bool
    guard: Any = None

    @property
    def state_sharded(self) -> bool:
        """Each process holds part of the optimizer's state (``training.optimizer_sharding``): a state save needs
        every process (:meth:`gather`), and the save's moment must be one they agree on."""
        from sd_scripts_compat.training.optimizer_sharding import is_sharded

        return is_sharded(self.optimizer)

    def gather(self) -> None:
        """Every process, before a state save: a sharded optimizer's parts sent to the main process."""
        from sd_scripts_compat.training.optimizer_sharding import gather_state

        gather_state(self.optimizer)

    def save_state(self, folder: Path, counters: TrainCounters) -> Path:
        """The state folder (the main process, after :meth:`gather` in every process)."""
        from sd_scripts_compat.training.train_state import save_train_state

        if self.guard is not None:
            self.guard.before_save()
        counters.extra["micro_batch"] = self.micro_batch  # a resume with another micro-batch re-maps the position
        return save_train_state(folder, lora_state=self.network.kohya_state_dict(), optimizer=self.optimizer,
                                lr_scheduler=self.lr_scheduler, counters=counters, settings=self.settings)

    def save_lora(self, path: Path, counters: TrainCounters, *, final: bool) -> None:
        from sd_scripts_compat.network.lora_file import build_metadata, save_lora_file

        if self.guard is not None:
            self.guard.before_save()
        # the final file's ss_epoch is the epochs trained (sd-scripts writes num_train_epochs), an intermediate
        # one's the epochs completed (at a step save mid-epoch, sd-scripts' 0-based epoch). Every save keeps the
        # run's output_name (ss_output_name, modelspec.title) and stamps ss_training_finished_at, as sd-scripts'
        # save_model does, whatever the file is called
        epoch = counters.epochs_begun if final else counters.epoch
        facts = replace(self.facts, epoch=epoch, steps=counters.global_step, training_finished_at=time.time())
        save_lora_file(path, self.network.kohya_state_dict(), build_metadata(self.family, facts),
                       save_dtype=self.save_dtype)

    def save_intermediate(self, counters: TrainCounters, *, suffix: str, step: int | None) -> None:
        """An intermediate LoRA (+ state with save_state) at an epoch end (``step`` None) or a step;
        then the old ones beyond save_last_n_* / save_last_n_*_state go. Every process calls it."""
        if self.policy.save_state:
            self.gather()
        if not self.is_main_process:
            return
        self.save_lora(self.paths.lora_file(suffix), counters, final=False)
        if self.policy.save_state:
            self.save_state(self.paths.state_dir(suffix), counters)
        name = glob.escape(self.paths.output_name)
        if step is None:
            _prune_newest(self.paths.output_dir.glob(f"{name}-[0-9]*.safetensors"), self.policy.keep_epoch_files)
            _prune_newest((p for p in self.paths.states_root.glob(f"{name}-[0-9]*-state") if p.is_dir()),
                          self.policy.keep_epoch_states)
        else:
            _prune_steps(self.paths.output_dir.glob(f"{name}-step*.safetensors"), self.policy.keep_step_files,
                         step, ".safetensors")
            _prune_steps((p for p in self.paths.states_root.glob(f"{name}-step*-state") if p.is_dir()),
                         self.policy.keep_step_states, step, "-state")


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _prune_newest(paths: Iterable[Path], keep: int | None) -> None:
    """Keep the newest ``keep`` (zero-padded names sort by epoch)."""
    if keep:
        for old in sorted(paths)[:-keep]:
            _remove(old)


def _prune_steps(paths: Iterable[Path], keep: int | None, step: int, ending: str) -> None:
    """Keep those of the last ``keep`` steps, as sd-scripts does: step s stays while s > step - keep."""
    if not keep:
        return
    for old in paths:
        number = old.name[: -len(ending)].rsplit("-step", 1)[1]
        if number.isdigit() and int(number) <= step - keep:
            _remove(old)
