"""Run the user's own sd-scripts (a checkout, or the one inside lora-scripts / kohya_ss) under the watchdog.

Most users already trust an sd-scripts install; ``autotune run --engine sd-scripts=PATH`` plans, then runs
*that* under the same OOM / kill / stall recovery our engine gets. sd-scripts does not follow our contract
(``sd_scripts_compat.facts.contract``), so this module stands in for it:

- finding it: PATH itself, or where lora-scripts and kohya_ss keep it (:data:`SCRIPT_PLACES`), and the
  Python of the venv those projects create beside it;
- checking it before anything long starts: the Python imports its ``library`` (else the import error's
  last line), ``train_network.py --help`` lists every option our config and command line use (an older or
  newer sd-scripts with other options is refused before launch, not after an hour);
- progress: its tqdm bar (``steps:  12%|...| 12/100 [00:10<01:13, 1.19it/s, avr_loss=0.123]``) becomes our
  ``progress.json``, so stall detection and the failed-step bookkeeping work unchanged; OOMs are found in
  its stderr by the watchdog's own detector (``looks_like_oom``), a SIGKILL by the exit status;
- saving and resuming the way sd-scripts can: ``--save_state --save_every_n_steps N`` (it has no
  time-based saves, so N comes from the measured step rate), ``--resume STATE --initial_step R
  --skip_until_initial_step``;
- owning the step count. sd-scripts' own counter is not trusted across resumes (upstream resume issues
  1999, 2171, 2248: after a resume its ``global_step`` and so its ``train_state.json`` ``current_step``,
  its state-folder names and its end condition can be off). The true step is R + the bar's count, every
  state folder's true step goes into a ledger (``state/sd_scripts.json``), R comes from the ledger and is
  passed as ``--initial_step`` (so a drifted ``current_step`` is never read back). When its counter is
  found off by D at the first save after a resume, the attempt is stopped and relaunched from the same
  state with ``max_train_steps`` = target + D, so it ends at the target step; a run that still ends short
  is continued from its end state. Only where the learning-rate schedule does not read ``max_train_steps``
  (:func:`schedule_reads_max_steps`): sd-scripts draws its other schedules over it, so the relaunch changed the
  rate of every later step (measured on sd-scripts 48d368fa, cosine over 30 steps: 2.2e-05 instead of 6.7e-05
  at step 13). There the counter is left off and the run may end a few steps past the target (sd-scripts' epoch
  count bounds it), which the log says.

Facts about sd-scripts used here that are not in the project's shared reference facts are marked ASSUMED; they come
from reading its code before and are checked against a stand-in in the tests, not against sd-scripts itself.
"""

from __future__ import annotations

import json
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

from autotune.layout import SD_SCRIPTS_LEDGER, STATE_DIR
from autotune.recovery import external
from autotune.recovery.external import (
    DEFAULT_IT_PER_S,
    SAVING,
    Bar,
    ChildHooks,
    StateLedger,
    parse_bar,
    save_every_n_steps,
    save_rate,
    write_progress,
)
from sd_scripts_compat.facts.atomic import write_json_atomic, write_text_atomic
from sd_scripts_compat.facts.contract import STATE_FILE, Outcome, state_step
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.kohya_toml import (
    flat_values,
    read_toml,
    set_config_values,
    without_keys,
    write_toml,
)

if TYPE_CHECKING:
    import argparse

    from autotune.recovery.attempt import AttemptResult
    from autotune.recovery.decisions import DecisionLog
    from autotune.recovery.engine import AttemptFiles
    from sd_scripts_compat.facts.families import FamilySpec

ENGINE_NAME = "sd-scripts"
TOKENIZER_DIR = f"{STATE_DIR}/sd_scripts_tokenizers"  # shipped tokenizers sd-scripts reads (it would download them)

# (folder under PATH, what it is): the places sd-scripts lives in the projects that ship it
SCRIPT_PLACES: tuple[tuple[str, str], ...] = (
    (".", "an sd-scripts checkout"),
    ("sd-scripts", "the sd-scripts inside a kohya_ss (or lora-scripts) folder"),
    ("scripts", "the sd-scripts of a lora-scripts (SD-Trainer) folder"),
    ("scripts/stable", "the stable sd-scripts of a lora-scripts (SD-Trainer) folder"),
    ("scripts/dev", "the dev sd-scripts of a lora-scripts (SD-Trainer) folder"),
    ("kohya_ss/sd-scripts", "the sd-scripts of the kohya_ss folder inside it"),
)
# the Pythons those projects create: their install scripts make a venv beside the code
PYTHON_PLACES = ("venv/bin/python", ".venv/bin/python", "venv/Scripts/python.exe", ".venv/Scripts/python.exe",
                 "python/python.exe", "python_embeded/python.exe")
LIBRARY_MODULE = "library.train_util"  # what every sd-scripts entry point imports first

# the options the wrapper itself passes; a version without them cannot be supervised
REQUIRED_OPTIONS = ("config_file", "dataset_config", "save_state", "save_every_n_steps", "resume",
                    "initial_step", "skip_until_initial_step", "max_train_steps")
# ASSUMED (sd-scripts library/train_util.py, sdxl_train_util.py): the hub names of its tokenizers; with
# --tokenizer_cache_dir it loads CACHE/<name with "/" -> "_"> when that folder exists, else downloads
TOKENIZER_HUB_NAMES = {"sd1": ("openai/clip-vit-large-patch14",), "sd2": ("stabilityai/stable-diffusion-2",),
                       "sdxl": ("openai/clip-vit-large-patch14", "laion/CLIP-ViT-bigG-14-laion2B-39B-b160k"),
                       # ASSUMED (library/strategy_sd3.py): CLIP_L / CLIP_G / T5_XXL_TOKENIZER_ID
                       "sd3": ("openai/clip-vit-large-patch14", "laion/CLIP-ViT-bigG-14-laion2B-39B-b160k",
                               "google/t5-v1_1-xxl")}
COUNTER_LAG = 2  # steps our reading of the bar can trail sd-scripts' own save (see AttemptWatch._fix_offset)

_EPOCH = re.compile(r"^\s*epoch (?P<epoch>\d+)/(?P<epochs>\d+)\s*$")
_VERSION = re.compile(r"(?:sd-scripts|kohya)[^\n]*?\bv?(?P<v>\d+\.\d+(?:\.\d+)?\S*)|version[:= ]+v?(?P<w>\d+\.\d+\S*)",
                      re.IGNORECASE)


# ---------------------------------------------------------------- finding and checking an install


@dataclass(frozen=True)
class Install:
    """An sd-scripts found under the user's PATH, and the Python that runs it."""

    root: Path  # what the user gave
    scripts_dir: Path  # the folder holding train_network.py and library/
    found_as: str  # which of SCRIPT_PLACES it was
    python: str
    python_origin: str

    def describe(self) -> str:
        return (f"sd-scripts: {self.scripts_dir} ({self.found_as}); python: {self.python} ({self.python_origin})")


def parse_engine(value: str | None) -> Path | None:
    """``--engine``: ``sd-scripts=PATH`` (the user's sd-scripts) or ``autotune`` / None (ours)."""
    if value in (None, "", "autotune"):
        return None
    kind, sep, path = str(value).partition("=")
    if kind != ENGINE_NAME or not sep or not path:
        raise UserError(f"--engine {value}: expected sd-scripts=PATH (an sd-scripts, lora-scripts or kohya_ss "
                        "folder), musubi-tuner=PATH (a musubi-tuner checkout) or autotune")
    return Path(path).expanduser()


def locate(path: Path) -> tuple[Path, str]:
    """The sd-scripts folder under ``path`` and which kind of layout it was found in."""
    if not path.is_dir():
        raise UserError(f"--engine sd-scripts={path}: no such folder; give an sd-scripts checkout, or the "
                        "lora-scripts / kohya_ss folder that holds one")
    for place, what in SCRIPT_PLACES:
        folder = Path(os.path.abspath(path / place))  # as the user named it (a symlinked layout stays readable)
        if (folder / "train_network.py").is_file() and (folder / "library" / "train_util.py").is_file():
            return folder, what
    looked = ", ".join(place for place, _ in SCRIPT_PLACES)
    raise UserError(f"--engine sd-scripts={path}: not sd-scripts: no train_network.py with library/train_util.py "
                    f"in {looked} under it; give the folder that holds train_network.py")


def choose_python(root: Path, scripts_dir: Path, given: str | None) -> tuple[str, str]:
    """``--python``, else the venv lora-scripts / kohya_ss create beside their code, else this Python."""
    return external.choose_python(given, dict.fromkeys((root.resolve(), scripts_dir)), PYTHON_PLACES,
                                  "sd-scripts", "no venv beside it")


def find_install(path: Path, python: str | None) -> Install:
    scripts_dir, found_as = locate(path)
    chosen, origin = choose_python(path, scripts_dir, python)
    return Install(path, scripts_dir, found_as, chosen, origin)


def check_import(install: Install, env: Mapping[str, str] | None = None, timeout_s: float = 600.0) -> None:
    """The Python must import sd-scripts' library from its folder; else a one-line error with the import
    error's last line (a missing package, a broken torch), before anything else is started."""
    try:
        done = subprocess.run([install.python, "-c", f"import {LIBRARY_MODULE}"], cwd=install.scripts_dir,
                              env=dict(env or os.environ), capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise UserError(f"{install.python}: cannot run it to import sd-scripts ({error}); pass --python "
                        "with the Python of your sd-scripts venv") from None
    if done.returncode != 0:
        raise UserError(f"{install.python} cannot import sd-scripts' {LIBRARY_MODULE} from {install.scripts_dir}: "
                        f"{external.last_line(done.stderr or done.stdout)}; install its requirements into that "
                        "Python "
                        f"(pip install -r {install.scripts_dir / 'requirements.txt'}) or pass --python")


@dataclass(frozen=True)
class ScriptOptions:
    """What one sd-scripts entry point accepts, read from its ``--help``, and its version."""

    script: Path
    names: frozenset[str]
    version: str


@dataclass
class OptionReader:
    """Reads a script's options once per (script, modification time): ``--help`` imports torch and takes a
    while, and a run asks several times (CLI flags, each attempt's config). In memory only."""

    env: Mapping[str, str] | None = None
    _cache: dict[tuple[str, str, int], ScriptOptions] = field(default_factory=dict)

    def options(self, install: Install, script_name: str) -> ScriptOptions:
        script = install.scripts_dir / script_name
        if not script.is_file():
            raise UserError(f"{install.scripts_dir}: no {script_name}, which this model family needs; update "
                            "sd-scripts (git pull in that folder)")
        key = (install.python, str(script), script.stat().st_mtime_ns)
        if key not in self._cache:
            self._cache[key] = _read_help(install, script, self.env)
        return self._cache[key]


def _read_help(install: Install, script: Path, env: Mapping[str, str] | None) -> ScriptOptions:
    out, err = external.read_help(install.python, script, cwd=install.scripts_dir, env=env or os.environ,
                                  fix="check that sd-scripts runs in that Python")
    version = _version(out + "\n" + err) or _git_version(install.scripts_dir) or "unknown"
    return ScriptOptions(script, frozenset(external.option_names(out)), version)


def _version(text: str) -> str | None:
    """The version sd-scripts prints (ASSUMED form: "sd-scripts ... v0.9.1" or "version: 0.9.1")."""
    match = _VERSION.search(text)
    return (match["v"] or match["w"]) if match else None


def _git_version(folder: Path) -> str | None:
    """The commit of a git checkout (also a submodule, whose .git is a file), read without running git."""
    git = folder / ".git"
    try:
        if git.is_file():
            git = (folder / git.read_text(encoding="utf-8").split(":", 1)[1].strip()).resolve()
        head = (git / "HEAD").read_text(encoding="utf-8").strip()
        if head.startswith("ref:"):
            head = (git / head.split(":", 1)[1].strip()).read_text(encoding="utf-8").strip()
        return f"git {head[:10]}" if re.fullmatch(r"[0-9a-f]{40}", head) else None
    except (OSError, IndexError):
        return None


def check_options(options: ScriptOptions, keys: list[str], source: str) -> None:
    """Refuse, before launch, any option ``source`` uses that this sd-scripts does not have.

    sd-scripts keeps unknown config keys silently, so without this an option it lacks would simply not
    happen (and a resume flag it lacks would restart the epoch hours later).
    """
    missing = [key for key in dict.fromkeys(keys) if key not in options.names]
    if missing:
        listed = ", ".join(f"--{key}" for key in missing)
        raise UserError(f"{source}: {options.script.name} of this sd-scripts (version {options.version}) has no "
                        f"{listed}; update sd-scripts, or remove {'it' if len(missing) == 1 else 'them'}")


def config_for_sd_scripts(config: Path, options: ScriptOptions, out: Path, values: Mapping[str, Any],
                          header: str) -> tuple[Path, list[str]]:
    """``config`` as a file for sd-scripts at ``out``: ``values`` set, wrapper-only keys (lora-scripts GUI
    keys, which sd-scripts ignores) removed, and any other key it does not know refused.

    ``values`` with a None value are removed (``max_train_epochs`` when the step count is pinned).
    Returns the path and the removed wrapper keys.
    """
    document = read_toml(config)
    dropped = check_config(config, options)
    removed = set(dropped) | {key for key, value in values.items() if value is None}
    document = without_keys(document, removed)
    document = set_config_values(document, {k: v for k, v in values.items() if v is not None})
    write_toml(out, document, header)
    return out, dropped


def check_config(config: Path, options: ScriptOptions) -> list[str]:
    """Refuse a config key this sd-scripts does not know; return the wrapper-only keys (lora-scripts GUI keys,
    which sd-scripts ignores: left out of what it is given, with a note)."""
    from sd_scripts_compat.config.training_config import WRAPPER_KEYS

    keys = list(flat_values(read_toml(config)))
    dropped = [key for key in keys if key in WRAPPER_KEYS and key not in options.names]
    check_options(options, [k for k in keys if k not in dropped], str(config))
    return dropped


def tokenizer_cache(out: Path, layout: str, pad_tokens: tuple[str, ...], t5: Path | None = None) -> Path:
    """A ``--tokenizer_cache_dir`` holding the tokenizers sd-scripts would download: CLIP's from the BPE vocabulary
    we ship, T5's (SD3) copied from ``t5`` when there is one (else sd-scripts downloads it), so it runs offline
    (it has no other way to be given a tokenizer)."""
    import shutil

    from sd_scripts_compat.facts.families import CLIP_TOKENIZER_DIR

    cache = out / TOKENIZER_DIR
    for index, hub_name in enumerate(TOKENIZER_HUB_NAMES[layout]):
        folder = cache / hub_name.replace("/", "_")
        if "t5" in hub_name:
            if t5 is not None and t5.is_dir() and not folder.exists():
                shutil.copytree(t5, folder)
                _older_transformers_config(folder / "tokenizer_config.json")
            elif t5 is not None and not folder.exists():  # a lone tokenizer.json
                folder.mkdir(parents=True)
                shutil.copy(t5, folder / "tokenizer.json")
            continue
        folder.mkdir(parents=True, exist_ok=True)
        for name in ("vocab.json", "merges.txt"):
            write_text_atomic(folder / name, (CLIP_TOKENIZER_DIR / name).read_text(encoding="utf-8"))
        pad = pad_tokens[index] if index < len(pad_tokens) else "<|endoftext|>"
        special = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
                   "pad_token": pad}
        write_json_atomic(folder / "special_tokens_map.json", special)
        write_json_atomic(folder / "tokenizer_config.json", {**special, "model_max_length": 77,
                                                             "do_lower_case": True, "errors": "replace",
                                                             "tokenizer_class": "CLIPTokenizer"})
    return cache


# ---------------------------------------------------------------- the ledger of true steps


def _state_mtime(folder: Path) -> int | None:
    """The modification time of a state folder's train_state.json (None: not a state folder)."""
    if folder.name.startswith(".") or not folder.name.endswith("-state"):
        return None
    try:
        return (folder / STATE_FILE).stat().st_mtime_ns
    except OSError:
        return None


# ---------------------------------------------------------------- one attempt's output


class AttemptWatch:
    """One sd-scripts attempt seen through its output: the bar becomes ``progress.json`` (true steps), the
    state folders it writes go into the ledger with their true steps, and a step counter that is off after
    a resume is caught at its first save (see the module docstring)."""

    def __init__(self, engine: SdScriptsEngine, resume: tuple[Path, int] | None, pinned_max: int | None,
                 expected_offset: int, config: Path) -> None:
        self.engine = engine
        self.resume_state = resume[0] if resume else None
        self.resume_step = resume[1] if resume else 0
        self.pinned_max = pinned_max
        self.expected_offset = expected_offset  # sd-scripts' count minus the true step, as arranged
        self.config = config
        self.events_dir: Path | None = None
        self.lock = threading.Lock()
        self.bar_offset: int | None = None
        self.true_step: int | None = None
        self.epoch: int | None = None
        self.it_per_s: float | None = None
        self.offset: int | None = None  # observed at the first save of this attempt
        self.announced: int | None = None  # sd-scripts' step in its last "saving state at step N" line
        self.unresolved: dict[str, tuple[int, int, int]] = {}  # folder -> (true step when seen, its step, mtime)
        self.stop_reason: str | None = None
        self.step_up_after: int | None = None  # a step up was asked at this true step ...
        self.stepped_up_at: int | None = None  # ... and the child was stopped after its whole state of this step
        self.notes: list[tuple[str, str, dict[str, Any]]] = []
        self.last_write = 0.0
        self.started_ns = time.time_ns()

    def feed(self, line: str) -> None:
        with self.lock:
            bar = parse_bar(line)
            if bar is None:
                epoch, saving = _EPOCH.match(line), SAVING.search(line)
                if epoch:
                    self.epoch = int(epoch["epoch"])
                if saving:
                    self.announced = int(saving["step"])
                return
            if not bar.is_steps:  # caching latents / loading: alive, not stepping
                if time.monotonic() - self.last_write >= 1.0:
                    self._write_progress(phase=bar.desc.strip() or "preparing")
                return
            self._on_steps(bar)

    def ask_step_up(self) -> None:
        with self.lock:
            self.step_up_after = self.true_step if self.true_step is not None else self.resume_step

    def _stop_for_step_up(self) -> None:
        """Once a state saved after the step-up request is whole, stop the child: the next attempt resumes there."""
        if self.step_up_after is None or self.stepped_up_at is not None:
            return
        whole = [int(e["step"]) for e in self.engine.ledger.states.values()
                 if e.get("confirmed") and int(e["step"]) > self.step_up_after]
        if whole:
            self.stepped_up_at = min(whole)
            self.engine.stop_child()

    def _on_steps(self, bar: Bar) -> None:
        ledger = self.engine.ledger
        if self.bar_offset is None:
            # sd-scripts' bar is tqdm(range(max_train_steps - initial_step)) counting from 0, its first redraw
            # 0/N (train_network.py, read by hand at main 48d368fa; after a resume its total is max_train_steps
            # less the start step's remainder within an epoch, which can equal max_train_steps); a version whose
            # bar counts globally would start at the resume step
            counts_globally = self.resume_step > 0 and bar.n >= self.resume_step
            self.bar_offset = 0 if counts_globally else self.resume_step
            if ledger.target_steps is None and self.resume_step == 0:
                ledger.target_steps = bar.total
                ledger.save()
        step = self.bar_offset + bar.n
        if bar.it_per_s:
            self.it_per_s = bar.it_per_s
        changed = step != self.true_step
        self.true_step = step
        if self.announced is not None:  # the redraw right after a save shows the saved step
            if self.offset is None:
                self._fix_offset(self.announced - step, f"step {self.announced}")
            self.announced = None
        if changed or time.monotonic() - self.last_write >= 1.0:
            self._write_progress(loss=bar.loss)
        self.scan(final=False, ok=False)  # every redraw: the one after a save shows that save's step

    def _write_progress(self, loss: float | None = None, phase: str | None = None) -> None:
        if self.events_dir is None:
            return
        write_progress(self.events_dir, ENGINE_NAME, self.true_step if self.true_step is not None else self.resume_step,
                       self.engine.ledger.target_steps, self.it_per_s, loss, phase, epoch=self.epoch)
        self.last_write = time.monotonic()

    def scan(self, *, final: bool, ok: bool) -> None:
        """Record the state folders sd-scripts wrote since the last look. A folder is confirmed (whole) once
        a later step was reported, or when the run ended well; a killed run's newest folder may be half.

        A new folder waits (``unresolved``) until this attempt's counter offset is known, from the save
        announcement (exact) or, failing that, from the bar line it was first seen on (``_fix_offset``).
        """
        ledger, states_dir = self.engine.ledger, self.engine.states_dir
        if not states_dir.is_dir():
            return
        current = self.true_step if self.true_step is not None else self.resume_step
        dirty = False
        for folder in sorted(states_dir.iterdir()):
            mtime = _state_mtime(folder)
            if mtime is None:
                continue
            entry = ledger.states.get(folder.name)
            if entry is not None and entry.get("mtime_ns") == mtime:
                if not entry.get("confirmed") and ((final and ok) or current > entry["step"]):
                    entry["confirmed"] = dirty = True
                continue
            if mtime < self.started_ns and entry is None:
                continue  # there before this attempt and never ours: newest() reads its own step
            sd_step = state_step(folder)
            seen = self.unresolved.get(folder.name)
            if sd_step is not None and (seen is None or seen[2] != mtime):
                self.unresolved[folder.name] = (current, sd_step, mtime)
        for name, (seen_at, sd_step, mtime) in list(self.unresolved.items()):
            if self.offset is None and (final or current > seen_at + COUNTER_LAG):
                self._fix_offset(sd_step - seen_at, name)  # no announcement came: the bar line it appeared on
            if self.offset is not None:
                ledger.states[name] = {"step": sd_step - self.offset, "sd_step": sd_step, "mtime_ns": mtime,
                                       "confirmed": bool(final and ok)}
                del self.unresolved[name]
                dirty = True
        gone = [name for name in ledger.states if not (states_dir / name).is_dir()]  # trimmed by sd-scripts
        for name in gone:
            del ledger.states[name]
        if dirty or gone:
            ledger.save()
        if not final:
            self._stop_for_step_up()

    def _fix_offset(self, observed: int, folder: str) -> None:
        """This attempt's counter offset (sd-scripts' step minus the true step), from its first save.

        ``observed`` is exact when it comes from the save announcement and the bar redraw right after it
        (ASSUMED order: update, save, announcement, redraw); from a folder seen on some bar line it can be
        a step or two off, since our pipe reader runs behind or ahead of the child. Within that lag of the
        arranged offset it is the arranged one; beyond, sd-scripts counts differently.
        """
        self.offset = self.expected_offset if abs(observed - self.expected_offset) <= COUNTER_LAG else observed
        if self.offset != self.expected_offset:
            self._counter_is_off(folder)

    def _counter_is_off(self, folder: str) -> None:
        offset, resume, target = self.offset or 0, self.resume_step, self.engine.ledger.target_steps
        what = (f"sd-scripts' step counter is off by {offset:+d} after resuming at step {resume} (seen at its "
                f"save {folder}; upstream resume issues 1999/2171/2248)")
        fixed_max = (target or 0) + offset
        if self.resume_state is None or target is None or self.expected_offset != 0:
            self.notes.append(("sd_scripts_counter", f"{what}; the ledger keeps the true steps",
                               {"offset": offset}))
            return
        schedule = flat_values(read_toml(self.config))
        if schedule_reads_max_steps(schedule):
            scheduler = schedule.get("lr_scheduler") or "constant"
            self.notes.append(("sd_scripts_counter", f"{what}; max_train_steps is kept, since the {scheduler} "
                               f"learning-rate schedule is drawn over it (a relaunch with max_train_steps {fixed_max} "
                               f"would change the rate of every later step); it may train past step {target}",
                               {"offset": offset}))
            return
        if fixed_max <= resume:  # sd-scripts requires max_train_steps > initial_step
            self.notes.append(("sd_scripts_counter", f"{what}; it cannot be made to stop at step {target} "
                               f"(max_train_steps would be {fixed_max}); it may train past it", {"offset": offset}))
            return
        self.engine.pending = (self.resume_state, resume, offset)
        self.stop_reason = (f"{what}: relaunching from step {resume} with max_train_steps {fixed_max} so that it "
                            f"stops at step {target}")
        self.engine.stop_child()


def schedule_reads_max_steps(config: Mapping[str, Any]) -> bool:
    """Whether sd-scripts' learning rate depends on ``max_train_steps`` (ASSUMED, read in its
    ``train_util.get_scheduler_fix`` at 48d368fa: every schedule but ``constant`` and ``constant_with_warmup``
    is drawn over it, and a warm-up given as a ratio is a share of it)."""
    scheduler = str(config.get("lr_scheduler") or "constant")
    warmup = config.get("lr_warmup_steps") or 0
    ratio = isinstance(warmup, float) and 0 < warmup < 1
    return scheduler not in ("constant", "constant_with_warmup") or (scheduler == "constant_with_warmup" and ratio)


# ---------------------------------------------------------------- the engine adapter


@dataclass
class SdScriptsEngine(ChildHooks):
    """The user's sd-scripts as an engine of the watchdog (``recovery.engine.Engine``)."""

    install: Install
    options: ScriptOptions
    output_dir: Path
    states_dir: Path
    save_every_s: float
    planned_it_per_s: float | None = None
    tokenizer_dir: Path | None = None
    extra_args: list[str] = field(default_factory=list)
    ledger: StateLedger = field(init=False)
    measured_it_per_s: float | None = None
    pending: tuple[Path, int, int] | None = None  # relaunch from (state, its step) with this counter offset
    watch: AttemptWatch | None = None
    pid: int | None = None
    save_every: tuple[int, float, str] = (0, DEFAULT_IT_PER_S, "")  # this attempt's (steps, it/s, source)

    def __post_init__(self) -> None:
        self.ledger = StateLedger.load(self.output_dir / SD_SCRIPTS_LEDGER)

    # -- hooks

    def newest_state(self, states_dir: Path) -> tuple[Path, int] | None:
        if self.pending is not None:
            return self.pending[0], self.pending[1]
        return self.ledger.newest(states_dir, _state_mtime, state_step)

    def attempt_argv(self, attempt: int, files: AttemptFiles, state: tuple[Path, int] | None,
                     log: DecisionLog) -> list[str]:
        """Write this attempt's config for sd-scripts and its command line; log both and what a failure loses."""
        config, dataset = files.config, files.dataset
        offset = self.pending[2] if self.pending and state and state[0] == self.pending[0] else 0
        self.pending = None
        target = self.ledger.target_steps
        values: dict[str, Any] = {}
        pinned = None
        if state is not None and target:  # the step count is pinned: a new micro-batch must not change it
            pinned = target + offset
            values = {"max_train_steps": pinned, "max_train_epochs": None}
        path = self.output_dir / STATE_DIR / f"sd_scripts.attempt{attempt}.toml"
        header = f"# attempt {attempt} for sd-scripts ({self.options.script.name}), written by autotune run\n"
        path, dropped = config_for_sd_scripts(config, self.options, path, values, header)
        if dropped:
            log.write("sd_scripts_keys", f"left out {', '.join(dropped)}: GUI keys sd-scripts ignores", keys=dropped)
        argv = self._argv(path, dataset, state, target)
        self.watch = AttemptWatch(self, state, pinned, offset, path)
        log.write("sd_scripts_command", f"attempt {attempt}: {shlex.join(argv)}", argv=argv)
        every, rate, source = self.save_every
        log.write("sd_scripts_saves", f"attempt {attempt}: sd-scripts has no time-based saves, so its state is "
                  f"saved every {every} step(s) (~{every / rate:.2g} s at {rate:.3g} it/s, {source}); a failure "
                  f"loses at most the {every} step(s) since the last save", save_every_n_steps=every, it_per_s=rate)
        return argv

    def _argv(self, config: Path, dataset: Path | None, state: tuple[Path, int] | None,
              target: int | None) -> list[str]:
        rate, source = save_rate(self.measured_it_per_s, self.planned_it_per_s)
        every = save_every_n_steps(self.save_every_s, rate, target)
        flat = flat_values(read_toml(config))
        argv = [self.install.python, str(self.options.script), "--config_file", str(config)]
        if dataset is not None:
            argv += ["--dataset_config", str(dataset)]
        argv += ["--save_state", "--save_every_n_steps", str(every)]
        for key in ("save_last_n_steps_state", "save_last_n_steps"):  # keep the last few, not hundreds
            if key not in flat and key in self.options.names:
                argv += [f"--{key}", str(2 * every)]
        if self.tokenizer_dir is not None and "tokenizer_cache_dir" not in flat:
            argv += ["--tokenizer_cache_dir", str(self.tokenizer_dir)]
        argv += list(self.extra_args)
        if state is not None:
            argv += ["--resume", str(state[0]), "--initial_step", str(state[1]), "--skip_until_initial_step"]
        check_options(self.options, external.option_names(" ".join(argv[2:])),
                      "autotune's command line for sd-scripts")
        self.save_every = (every, rate, source)
        return argv

    def finish(self, result: AttemptResult, log: DecisionLog) -> AttemptResult:
        watch = self.watch
        assert watch is not None
        watch.scan(final=True, ok=result.outcome is Outcome.DONE)
        if watch.it_per_s:
            self.measured_it_per_s = watch.it_per_s
        for event, text, data in watch.notes:
            log.write(event, text, **data)
        if watch.stepped_up_at is not None and result.outcome is not Outcome.DONE:
            return replace(result, outcome=Outcome.STEP_UP, message=f"stopped sd-scripts after its state at step "
                           f"{watch.stepped_up_at} for a step up")
        if watch.stop_reason is not None and result.outcome is Outcome.CRASH:
            return replace(result, outcome=Outcome.CONTINUE, message=watch.stop_reason)
        if result.outcome is Outcome.INTERRUPTED:  # ASSUMED: sd-scripts has no SIGINT handler (KeyboardInterrupt)
            newest = self.ledger.newest(self.states_dir, _state_mtime, state_step)
            return replace(result, message="interrupted; sd-scripts saves no state on Ctrl-C: --resume continues "
                           f"from its last step save ({newest[0].name if newest else 'none yet'})")
        if result.outcome is not Outcome.DONE:
            return result
        return self._finished(result, watch, log)

    def _finished(self, result: AttemptResult, watch: AttemptWatch, log: DecisionLog) -> AttemptResult:
        target, reached = self.ledger.target_steps, watch.true_step
        if target is not None and reached is not None and reached < target:
            if reached <= watch.resume_step:
                return replace(result, outcome=Outcome.CRASH, message=f"sd-scripts ended at step {reached} without "
                               f"training (target {target}); see its log")
            return replace(result, outcome=Outcome.CONTINUE, message=f"sd-scripts stopped at step {reached} of "
                           f"{target}: continuing from its end state")
        if target is not None and reached is not None and reached > target:
            log.write("sd_scripts_counter", f"sd-scripts trained {reached - target} step(s) past the target "
                      f"{target} (its step counter after a resume)", steps=reached, target=target)
        flat = flat_values(read_toml(watch.config))
        # ASSUMED: sd-scripts names the last LoRA output_name (default "last") + "." + save_model_as
        name = f"{flat.get('output_name') or 'last'}.{flat.get('save_model_as') or 'safetensors'}"
        output = Path(str(flat.get("output_dir") or self.states_dir)) / name
        return replace(result, done_event={"output_file": str(output) if output.is_file() else None,
                                           "steps": reached, "engine": ENGINE_NAME})


# ---------------------------------------------------------------- setting it up


def early_check(engine: str, python: str | None, model: str | None) -> Install:
    """The cheap refusals, before the dataset check and the plan: a PATH that is not sd-scripts, a
    --python that is not a program, a model only autotune's engine can load."""
    from sd_scripts_compat.models.detect import BUILTIN_PREFIX

    root = parse_engine(engine)
    if root is None:
        raise UserError(f"--engine {engine}: nothing to wrap; drop --engine to use autotune's engine")
    install = find_install(root, python)
    if model and str(model).startswith(BUILTIN_PREFIX):
        raise UserError(f"--model {model}: a built-in test model only autotune's engine can load; give sd-scripts "
                        "a .safetensors checkpoint or a diffusers folder")
    return install


def check(args: argparse.Namespace) -> None:
    """``autotune run --engine sd-scripts=PATH``'s cheap refusals (``early_check``), before planning."""
    early_check(args.engine, args.python, args.model)


def offer(root: Path, python: str | None) -> list[str]:
    """``autotune ui --engine``: this sd-scripts' ``autotune run`` options, checked now, with absolute paths (runs
    start in the runs folder)."""
    install = find_install(root, python)
    return ["--engine", f"{ENGINE_NAME}={root.resolve()}", "--python", str(install.python)]


def _older_transformers_config(path: Path) -> None:
    """transformers 5 writes ``extra_special_tokens`` as a list, which the 4.x sd-scripts pins cannot read (it wants
    a mapping): the same tokens as 4.x spells them (``additional_special_tokens``)."""
    if not path.is_file():
        return
    config = json.loads(path.read_text(encoding="utf-8"))
    extra = config.get("extra_special_tokens")
    if isinstance(extra, list):
        config["extra_special_tokens"] = {}
        if extra:
            config["additional_special_tokens"] = extra
        write_json_atomic(path, config)


def _t5_tokenizer(family: FamilySpec, config: Path) -> Path | None:
    """The T5 tokenizer to hand sd-scripts: a tiny family's shipped one, else one beside the config's t5xxl file."""
    from sd_scripts_compat.models.t5_tokenizer import TINY_T5_TOKENIZER_DIR, find_t5_tokenizer

    if not any(te.tokenizer_kind == "t5" for te in family.text_encoders):
        return None
    if family.tiny:
        return Path(TINY_T5_TOKENIZER_DIR)
    import toml

    try:
        t5xxl = toml.loads(config.read_text(encoding="utf-8")).get("t5xxl")
    except (OSError, toml.TomlDecodeError):
        return None
    return find_t5_tokenizer(None, t5xxl) if t5xxl else None


def prepare(engine: str, python: str | None, *, family: FamilySpec, config: Path, output_dir: Path, states_dir: Path,
            save_every_s: float, env: Mapping[str, str], planned_it_per_s: float | None = None,
            extra_args: list[str] | None = None) -> SdScriptsEngine:
    """Find and check the user's sd-scripts for ``autotune run``; every refusal comes before any training."""
    root = parse_engine(engine)
    assert root is not None
    install = find_install(root, python)
    print(install.describe())
    check_import(install, env)
    options = OptionReader(env).options(install, family.kohya_script)
    print(f"sd-scripts version {options.version}: {options.script.name} has {len(options.names)} options")
    check_options(options, list(REQUIRED_OPTIONS), f"{options.script} (what autotune needs to save and resume)")
    tokenizers = None
    if "tokenizer_cache_dir" in options.names and family.single_file_layout in TOKENIZER_HUB_NAMES:
        pads = tuple(str(te.tokenizer.get("pad_token") or "<|endoftext|>") for te in family.text_encoders)
        tokenizers = tokenizer_cache(output_dir, family.single_file_layout, pads, _t5_tokenizer(family, config))
    result = SdScriptsEngine(install, options, output_dir, states_dir, save_every_s, planned_it_per_s, tokenizers,
                             list(extra_args or []))
    check_config(config, options)
    return result


def train_config(engine: str, python: str | None, *, model: str, config: Path, kohya_args: list[str]) -> int:
    """``autotune train CONFIG --engine sd-scripts=PATH`` (the registry's ``train_config``): the early checks, then
    :func:`train_with_sd_scripts`."""
    from sd_scripts_compat.models.detect import detect_family

    family = detect_family(model)
    early_check(engine, python, model)
    return train_with_sd_scripts(engine, python, family=family, config=config, kohya_args=kohya_args)


def train_with_sd_scripts(engine: str, python: str | None, *, family: FamilySpec, config: Path,
                          kohya_args: list[str]) -> int:
    """``autotune train CONFIG --engine sd-scripts=PATH``: the same checks, then sd-scripts itself runs the
    config in the foreground (no watchdog: ``autotune run`` is the supervised way)."""
    root = parse_engine(engine)
    assert root is not None
    install = find_install(root, python)
    print(install.describe())
    check_import(install)
    options = OptionReader().options(install, family.kohya_script)
    print(f"sd-scripts version {options.version}")
    check_config(config, options)  # the wrapper keys it ignores stay: this is the user's own file
    check_options(options, external.option_names(" ".join(kohya_args)), "the command line")
    argv = [install.python, str(options.script), "--config_file", str(config), *kohya_args]
    print(f"$ {shlex.join(argv)}", flush=True)
    return subprocess.run(argv).returncode

