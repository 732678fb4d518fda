"""Run the user's own musubi-tuner (kohya's trainer of Qwen-Image, FLUX.2, Wan and Z-Image) under the watchdog.

``autotune run DATASET --model DIT --engine musubi-tuner=PATH`` plans, writes musubi's own files (dataset.toml,
config.toml, as ``autotune plan`` does), and then, for every attempt: runs the latent and text-encoder caching
scripts (``--skip_existing``: a resumed or stepped-down attempt caches only what is new, e.g. a lower resolution)
and the training script, supervised like our engine (OOM -> more swapped blocks, then resolution / frames, then
rank; SIGKILL and stalls -> resume). What musubi-tuner does, read in its code (training/trainer_base.py,
utils/train_utils.py at 30c658c), and what this module does about it:

- progress: its bar is ``tqdm(range(max_train_steps), desc="steps")`` on stderr; the bar becomes our
  ``progress.json`` (true steps), so stall detection works unchanged; an OOM is found in its stderr by the
  watchdog's own detector, a SIGKILL by the exit status;
- saves: ``--save_state --save_every_n_steps N`` (N from the measured step rate: it has no time-based saves) writes
  ``{output_name}-step{N:08d}-state`` after "saving state at step N" and redraws the bar: a folder is whole once that
  redraw (or a later step) is seen;
- resuming: ``--resume STATE`` restores the LoRA, the optimizer, the LR scheduler's step and the RNG states
  (``accelerator.load_state``), but its step counter restarts at 0, so its state names, its ``ss_steps`` and its end
  condition would be off. We own the step count: every attempt trains under its own ``output_name``
  ``{name}-from{R:08d}`` (R its start step), so a state folder's true step is R + the step in its name and no
  attempt overwrites another's folders; a resumed attempt runs with the original ``max_train_steps`` (the
  restored scheduler then continues on the original horizon: cosine and warm-up stay where they were, which
  ``max_train_steps`` = the remaining steps would bend) and saves at a divisor of the remaining steps, so it saves at
  exactly the target step; we stop it there and keep that LoRA as the final one, its ``ss_steps`` set to the true
  step count;
- what it cannot restore: the data position. musubi has no option to skip to a step, so a resumed attempt draws
  its epoch from the start again (the same samples in the same order as the first epoch, with the same seed); and
  its epoch count restarts, so epoch-numbered saves (``save_every_n_epochs``) are left out of resumed attempts.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.layout import MUSUBI_LEDGER, STATE_DIR
from autotune.recovery import external
from autotune.recovery.external import (
    SAVING,
    ChildHooks,
    StateLedger,
    parse_bar,
    remaining_divisor,
    save_every_n_steps,
    save_rate,
    write_progress,
)
from sd_scripts_compat.facts.contract import DONE, Outcome, write_event
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.kohya_toml import read_toml, set_dataset_values, write_toml
from sd_scripts_compat.facts.musubi_args import MUSUBI_NAMES

if TYPE_CHECKING:
    from autotune.recovery.attempt import AttemptResult
    from autotune.recovery.decisions import DecisionLog
    from autotune.recovery.engine import AttemptFiles
    from sd_scripts_compat.facts.families import FamilySpec
    from sd_scripts_compat.facts.settings import TrainSettings

ENGINE_NAME = "musubi-tuner"
PYTHON_PLACES = (".venv/bin/python", "venv/bin/python", ".venv/Scripts/python.exe", "venv/Scripts/python.exe")
REQUIRED_OPTIONS = ("config_file", "dataset_config", "save_state", "save_every_n_steps", "resume", "max_train_steps",
                    "output_dir", "output_name")
_STATE = re.compile(r"^(?P<name>.+)-from(?P<start>\d{8})-step(?P<step>\d{8})-state$")


# ---------------------------------------------------------------- finding and checking an install


@dataclass(frozen=True)
class MusubiInstall:
    root: Path  # the checkout: src/musubi_tuner/ holds the scripts
    python: str
    python_origin: str

    @property
    def scripts(self) -> Path:
        return self.root / "src" / "musubi_tuner"

    def describe(self) -> str:
        return f"musubi-tuner: {self.root}; python: {self.python} ({self.python_origin})"

    def env(self, base: Mapping[str, str]) -> dict[str, str]:
        """The scripts import ``musubi_tuner.*``: its ``src`` on the path, as its own docs run them."""
        path = base.get("PYTHONPATH")
        return {**base, "PYTHONPATH": str(self.root / "src") + (os.pathsep + path if path else "")}


def parse_engine(value: str | None) -> Path | None:
    kind, sep, path = str(value or "").partition("=")
    return Path(path).expanduser() if kind == ENGINE_NAME and sep and path else None


def find_install(path: Path, python: str | None, family: FamilySpec) -> MusubiInstall:
    if not path.is_dir():
        raise UserError(f"--engine musubi-tuner={path}: no such folder; give your musubi-tuner checkout")
    root = Path(os.path.abspath(path))
    if not (root / "src" / "musubi_tuner" / family.kohya_script).is_file():
        raise UserError(f"--engine musubi-tuner={path}: not a musubi-tuner checkout with {family.description}: no "
                        f"src/musubi_tuner/{family.kohya_script} in it; give the folder you cloned (git pull it if "
                        "it is older than the family)")
    return MusubiInstall(root, *find_python(root, python))


def find_python(root: Path, python: str | None) -> tuple[str, str]:
    """``--python``, else the venv in the checkout (its docs make one there), else this Python; and where from."""
    return external.choose_python(python, (root,), PYTHON_PLACES, "musubi-tuner", "no venv in it")


def offer(root: Path, python: str | None) -> list[str]:
    """``autotune ui --engine``: this musubi-tuner's ``autotune run`` options, checked now, with absolute paths."""
    if not (root / "src" / "musubi_tuner").is_dir():
        raise UserError(f"--engine {ENGINE_NAME}={root}: not a musubi-tuner checkout (no src/musubi_tuner in it); "
                        "give the folder you cloned")
    chosen = find_python(root.resolve(), python)
    return ["--engine", f"{ENGINE_NAME}={root.resolve()}", "--python", chosen[0]]


def script_options(install: MusubiInstall, script: str, env: Mapping[str, str]) -> frozenset[str]:
    """The options ``script`` of this musubi-tuner accepts, read from its ``--help`` (its version's, not ours)."""
    out, _ = external.read_help(install.python, install.scripts / script, cwd=install.root, env=install.env(env),
                                fix="install musubi-tuner's requirements into that Python, or pass --python")
    return frozenset(external.option_names(out))


def check_options(names: frozenset[str], wanted: list[str], source: str, script: str) -> None:
    missing = [name for name in dict.fromkeys(wanted) if name not in names]
    if missing:
        raise UserError(f"{source}: {script} of this musubi-tuner has no {', '.join('--' + m for m in missing)}; "
                        "update musubi-tuner (git pull), or remove them")


# ---------------------------------------------------------------- the files of one attempt


def musubi_values(settings: TrainSettings, base: TrainSettings, script: str) -> dict[str, Any]:
    """The training-config values of ``settings`` that differ from ``base``, in musubi's names, those ``script``
    has (the dataset's values go to the dataset TOML); None for a key ``base`` writes and ``settings`` does not
    (``blocks_to_swap`` once none are swapped), to be removed."""
    from sd_scripts_compat.facts.musubi_args import musubi_options
    from sd_scripts_compat.facts.settings_space import config_values

    new, old = config_values(settings), config_values(base)
    table = musubi_options(script.removesuffix(".py"))
    changed = {**{k: None for k in old if k not in new}, **{k: v for k, v in new.items() if old.get(k) != v}}
    return {MUSUBI_NAMES.get(k, k): v for k, v in changed.items() if MUSUBI_NAMES.get(k, k) in table}


def write_attempt_files(config: Path, dataset: Path, settings: TrainSettings, base: TrainSettings, out_dir: Path,
                        attempt: int, drop: tuple[str, ...], script: str) -> tuple[Path, Path]:
    """This attempt's config.toml and dataset.toml for musubi: the job's, with the settings the ladder changed
    (resolution, micro-batch and frames in the dataset; the rest in the config) and ``drop`` removed."""
    from sd_scripts_compat.facts.kohya_toml import set_config_values, without_keys

    values = musubi_values(settings, base, script)
    gone = {k for k, v in values.items() if v is None}
    document = set_config_values(without_keys(read_toml(config), {*drop, *gone}),
                                 {k: v for k, v in values.items() if v is not None})
    data = read_toml(dataset, "dataset config")
    changes: dict[str, Any] = {}
    if settings.resolution != base.resolution:
        changes["resolution"] = list(settings.resolution)
    if settings.train_batch_size != base.train_batch_size:
        changes["batch_size"] = settings.train_batch_size
    if settings.frames != base.frames:
        changes["target_frames"] = [settings.frames]
    data = set_dataset_values(data, changes) if changes else data
    for entry in data.get("datasets") or []:  # the plan's paths are relative to its folder; the trainer's cwd is not
        for key in ("image_directory", "video_directory", "cache_directory"):
            if isinstance(entry.get(key), str):
                entry[key] = str(config.parent / entry[key])
    out_dir.mkdir(parents=True, exist_ok=True)
    config_out = out_dir / f"musubi.attempt{attempt}.config.toml"
    dataset_out = out_dir / f"musubi.attempt{attempt}.dataset.toml"
    document["dataset_config"] = str(dataset_out)
    write_toml(config_out, document, f"# attempt {attempt} for musubi-tuner, written by autotune run\n")
    write_toml(dataset_out, data, f"# attempt {attempt}'s dataset for musubi-tuner, written by autotune run\n")
    return config_out, dataset_out


# ---------------------------------------------------------------- the ledger of true steps


def _folder_stamp(folder: Path) -> int | None:
    """A state folder's modification time (None: not a folder); the ledger knows which are whole."""
    try:
        return folder.stat().st_mtime_ns if folder.is_dir() else None
    except OSError:
        return None


def true_step(folder_name: str) -> int | None:
    match = _STATE.match(folder_name)
    return int(match["start"]) + int(match["step"]) if match else None


# ---------------------------------------------------------------- one attempt's output


class MusubiWatch:
    """One attempt seen through its output: true steps into ``progress.json``, whole state folders into the
    ledger, and the stop at the target step of a resumed attempt."""

    def __init__(self, engine: MusubiEngine, start: int, name: str) -> None:
        self.engine, self.start, self.name = engine, start, name
        self.events_dir: Path | None = None
        self.lock = threading.Lock()
        self.step: int | None = None  # musubi's own count in this attempt
        self.it_per_s: float | None = None
        self.announced: int | None = None
        self.reached_target = False
        self.step_up_after: int | None = None  # a step up was asked at this true step ...
        self.stepped_up_at: int | None = None  # ... and the child was stopped after its whole state of this step
        self.last_write = 0.0

    def ask_step_up(self) -> None:
        with self.lock:
            self.step_up_after = self.start + (self.step or 0)

    def feed(self, line: str) -> None:
        with self.lock:
            saving = SAVING.search(line)
            if saving:
                self.announced = int(saving["step"])
                return
            bar = parse_bar(line)
            if bar is None:
                return
            if not bar.is_steps:
                if time.monotonic() - self.last_write >= 1.0:
                    self._progress(phase=bar.desc.strip() or "preparing")
                return
            self._on_steps(bar.n, bar.total, bar.it_per_s, bar.loss)

    def _on_steps(self, n: int, total: int, it_per_s: float | None, loss: float | None) -> None:
        ledger = self.engine.ledger
        if self.reached_target:  # stopped at the target: a step it began before the stop does not count
            return
        if ledger.target_steps is None and self.start == 0:
            ledger.target_steps = total
            ledger.save()
        changed, self.step = n != self.step, n
        self.it_per_s = it_per_s or self.it_per_s
        if self.announced is not None and n >= self.announced:  # the redraw after the save: the folder is whole
            self._whole(self.announced)
            self.announced = None
        if changed:
            self._whole_before(n)
        if changed or time.monotonic() - self.last_write >= 1.0:
            self._progress(loss=loss)
        target = ledger.target_steps
        if self.start and target and self.start + n >= target and self._has_whole(target - self.start):
            self.reached_target = True
            self.engine.stop_child()

    def _whole(self, step: int) -> None:
        name = f"{self.name}-step{step:08d}-state"
        if (self.engine.states_dir / name).is_dir():
            self.engine.ledger.states[name] = {"step": self.start + step, "confirmed": True}
            self.engine.ledger.save()
            if self.step_up_after is not None and self.stepped_up_at is None and self.start + step > self.step_up_after:
                self.stepped_up_at = self.start + step  # whole after the request: the step up resumes from it
                self.engine.stop_child()

    def _whole_before(self, n: int) -> None:
        """Folders of steps before ``n`` are whole (musubi saves before its next step), also when its log does not
        show the "saving state" line."""
        prefix = f"{self.name}-step"
        for folder in self.engine.states_dir.glob(f"{prefix}*-state"):
            step = folder.name[len(prefix):-len("-state")]
            if step.isdigit() and int(step) < n and folder.name not in self.engine.ledger.states:
                self._whole(int(step))

    def _has_whole(self, step: int) -> bool:
        return f"{self.name}-step{step:08d}-state" in self.engine.ledger.states

    def _progress(self, loss: float | None = None, phase: str | None = None) -> None:
        if self.events_dir is None:
            return
        write_progress(self.events_dir, ENGINE_NAME, self.start + (self.step or 0), self.engine.ledger.target_steps,
                       self.it_per_s, loss, phase)
        self.last_write = time.monotonic()


# ---------------------------------------------------------------- the engine adapter


@dataclass
class MusubiEngine(ChildHooks):
    """The user's musubi-tuner as an engine of the watchdog (``recovery.engine.Engine``)."""

    install: MusubiInstall
    family: FamilySpec
    run_dir: Path  # the plan's folder: dataset.toml, config.toml, the caches; the children's working folder
    base: TrainSettings
    models: dict[str, str]  # dit, vae, text_encoder (Wan: t5) -> file: the values of the commands' $DIT, $VAE ...
    commands: tuple[tuple[str, ...], ...]  # the plan's (musubi_train.sh's): cache latents, cache text, train
    output_name: str
    save_every_s: float
    env: dict[str, str]
    planned_it_per_s: float | None = None
    options: dict[str, frozenset[str]] = field(default_factory=dict)
    ledger: StateLedger = field(init=False)
    watch: MusubiWatch | None = None
    pid: int | None = None
    measured_it_per_s: float | None = None

    def __post_init__(self) -> None:
        self.ledger = StateLedger.load(self.run_dir / MUSUBI_LEDGER)

    @property
    def states_dir(self) -> Path:
        return self.run_dir

    def newest_state(self, states_dir: Path) -> tuple[Path, int] | None:
        return self.ledger.newest(states_dir, _folder_stamp)

    def _argv(self, command: tuple[str, ...], files: Mapping[str, Path]) -> list[str]:
        """One of the plan's commands for this checkout (the script under its ``src``), these model files (its
        ``$DIT``, ``$VAE`` ... variables) and this attempt's files (in place of the run folder's ``dataset.toml``
        and ``config.toml``), run by the install's Python (the launcher words before the script left out)."""
        at = next(i for i, word in enumerate(command) if word.startswith("src/musubi_tuner/"))
        words = [str(self.install.root / command[at])]
        for word in command[at + 1:]:
            if word.startswith("$"):
                name = word[1:].lower()
                if name not in self.models:
                    raise UserError(f"musubi-tuner's {Path(command[at]).name} needs the {name} file; give it with "
                                    f"--{name} FILE")
                word = self.models[name]
            words.append(str(files.get(word, word)))
        return [self.install.python, *words]

    def attempt_argv(self, attempt: int, files: AttemptFiles, state: tuple[Path, int] | None,
                     log: DecisionLog) -> list[str]:
        settings = files.settings or self.base
        start = state[1] if state else 0
        target = self.ledger.target_steps
        drop = ("max_train_epochs", "save_every_n_epochs", "save_last_n_epochs") if state else ()
        config, dataset = write_attempt_files(self.run_dir / "config.toml", self.run_dir / "dataset.toml", settings,
                                              self.base, self.run_dir / STATE_DIR, attempt, drop,
                                              self.family.kohya_script)
        self._cache(dataset, log)
        rate, source = save_rate(self.measured_it_per_s, self.planned_it_per_s)
        every = save_every_n_steps(self.save_every_s, rate, target)
        name = f"{self.output_name}-from{start:08d}"
        argv = [*self._argv(self.commands[2], {"config.toml": config}), "--output_dir", str(self.run_dir),
                "--output_name", name, "--save_state"]
        if state is not None and target:
            every = remaining_divisor(target - start, every)
            argv += ["--resume", str(state[0]), "--max_train_steps", str(target)]
        argv += ["--save_every_n_steps", str(every), "--save_last_n_steps_state", "2", "--save_last_n_steps", "2"]
        self._check(argv, self.family.kohya_script)
        self.watch = MusubiWatch(self, start, name)
        log.write("musubi_command", f"attempt {attempt}: {shlex.join(argv)}", argv=argv)
        log.write("musubi_saves", f"attempt {attempt}: state saved every {every} step(s) (~{every / rate:.2g} s at "
                  f"{rate:.3g} it/s, {source}); a failure loses at most those steps", save_every_n_steps=every)
        return argv

    def _check(self, argv: list[str], script: str) -> None:
        if script not in self.options:
            self.options[script] = script_options(self.install, script, self.env)
            check_options(self.options[script], list(REQUIRED_OPTIONS) if script == self.family.kohya_script else [],
                          f"{self.install.scripts / script} (what autotune needs to save and resume)", script)
        check_options(self.options[script], external.option_names(" ".join(argv[2:])),
                      "autotune's command line for musubi-tuner", script)

    def _cache(self, dataset: Path, log: DecisionLog) -> None:
        """The plan's two caching steps on this attempt's dataset; what is cached already is kept
        (``--skip_existing``)."""
        for what, command in zip(("cache latents", "cache text encoder outputs"), self.commands[:2], strict=True):
            argv = [*self._argv(command, {"dataset.toml": dataset}), "--skip_existing"]
            script = Path(argv[1]).name
            self._check(argv, script)
            log.write("musubi_cache", f"{what}: {shlex.join(argv)}", argv=argv)
            done = subprocess.run(argv, cwd=self.run_dir, env=self.install.env(self.env), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, check=False)
            with (self.run_dir / STATE_DIR / "musubi_cache.log").open("a", encoding="utf-8") as handle:
                handle.write(done.stdout)
            if done.returncode != 0:
                lines = [line for line in done.stdout.replace("\r", "\n").splitlines() if line.strip()]
                read = ", ".join(self.models.get(w[1:].lower(), w) for w in command if w.startswith("$"))
                raise UserError(f"musubi-tuner's {script} failed: {lines[-1] if lines else 'no output'}; check the "
                                f"file it read ({read}) and that musubi-tuner runs in {self.install.python}")

    def finish(self, result: AttemptResult, log: DecisionLog) -> AttemptResult:
        watch = self.watch
        assert watch is not None
        if watch.it_per_s:
            self.measured_it_per_s = watch.it_per_s
        done = result.outcome is Outcome.DONE
        if watch.stepped_up_at is not None and not done and not watch.reached_target:
            return replace(result, outcome=Outcome.STEP_UP, message=f"stopped musubi-tuner after its state at step "
                           f"{watch.stepped_up_at} for a step up")
        if watch.reached_target or (done and watch.start == 0):
            return self._final(result, watch, log)
        if done:
            return replace(result, outcome=Outcome.CRASH, message=f"musubi-tuner ended at step "
                           f"{watch.start + (watch.step or 0)} before the target {self.ledger.target_steps}")
        return result

    def _final(self, result: AttemptResult, watch: MusubiWatch, log: DecisionLog) -> AttemptResult:
        """The attempt's last LoRA as ``{output_name}.safetensors``, its ``ss_steps`` the true step count."""
        target = self.ledger.target_steps or watch.start + (watch.step or 0)
        source = self.run_dir / (f"{watch.name}-step{target - watch.start:08d}.safetensors" if watch.start
                                 else f"{watch.name}.safetensors")
        final = self.run_dir / f"{self.output_name}.safetensors"
        if not source.is_file():
            return replace(result, outcome=Outcome.CRASH, message=f"musubi-tuner wrote no {source.name}")
        relabel_steps(source, final, target)
        if watch.start:
            log.write("musubi_stop", f"stopped musubi-tuner at the target step {target} (its own count "
                      f"{target - watch.start}); LoRA {final.name} from {source.name}", steps=target)
        done = {"output_file": str(final), "steps": target, "engine": ENGINE_NAME}
        if watch.events_dir is not None:  # the report and the web app read the run's end and its LoRA from it
            write_event(watch.events_dir, DONE, done)
        return replace(result, outcome=Outcome.DONE, message="finished", done_event=done)


def relabel_steps(source: Path, final: Path, steps: int) -> None:
    """``source`` written to ``final`` as one uninterrupted run would have written it: ``ss_steps`` the true step
    count (musubi writes its own, which restarts at every launch), the run's name where musubi wrote the attempt's
    (``ss_output_name``, and ``modelspec.title`` unless the user titled it), and the hashes musubi precalculates
    from the tensors and ``ss_*`` keys computed again for those keys; the tensors unchanged."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from sd_scripts_compat.network.lora_file import training_hashes

    with safe_open(str(source), framework="pt") as handle:
        metadata = dict(handle.metadata() or {})
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 - safe_open has no iteration
    attempt, name = _attempt_name(source), final.stem
    metadata["ss_steps"] = str(steps)
    for key in ("ss_output_name", "modelspec.title"):
        if metadata.get(key) == attempt:
            metadata[key] = name
    if "sshs_model_hash" in metadata or "sshs_legacy_hash" in metadata:  # musubi's precalculate_safetensors_hashes
        metadata.update(training_hashes(tensors, metadata))
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, final)


def _attempt_name(source: Path) -> str:
    """The output_name musubi trained the attempt under: the file's stem without its ``-stepNNNNNNNN`` suffix."""
    return re.sub(r"-step\d{8}$", "", source.stem)
