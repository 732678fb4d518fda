"""Start a supervised training run: the one function ``autotune run``, the wizard and the web app call.

``start_run(args)`` checks the dataset, probes, plans (or copies the user's config), writes the configs into the
output folder and trains under the watchdog (``autotune.recovery``), which steps down after an OOM, rolls back
after a diverged loss and resumes from the last saved state; at the end it prints the run's report. ``args`` are
the options ``add_arguments`` declares (the same for every caller).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.launch.arg_types import finite
from autotune.launch.engines import check_engine, parse_engine
from autotune.layout import (
    CONFIG,
    DECISIONS_LOG,
    EVENTS_DIR,
    FINAL_CONFIG,
    REPORT_HTML,
    RUN_STATE,
    STATE_DIR,
    TRAINER_PID,
    default_out,
    run_root,
)
from autotune.own_files import refuse_foreign_configs, refuse_out_in_dataset, run_traces
from sd_scripts_compat.facts.errors import BadWeights, UserError

if TYPE_CHECKING:
    import contextlib
    from collections.abc import Callable, Iterator

    from autotune.hardware.probe import SystemProbe
    from autotune.measure.store import Measurement
    from autotune.recovery.watchdog import Job
    from sd_scripts_compat.facts.dataset_scan import DatasetScan
    from sd_scripts_compat.facts.families import FamilySpec
    from sd_scripts_compat.facts.settings import TrainSettings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from autotune.launch import plan_options as plan_command

    plan_command.add_arguments(parser)  # the same plan options as `autotune plan` (--gpu/--vram/--goal/...)
    parser.set_defaults(out=None)
    parser.add_argument("--config", help="use this kohya config.toml instead of planning")
    parser.add_argument("--dataset-config", help="with --config: a kohya dataset.toml to use")
    parser.add_argument("--resume", nargs="?", const=True, default=False, metavar="RUN",
                        help="continue an interrupted run from its newest state: the run in --out (or the default "
                             "folder), or RUN: its folder or any file in it")
    parser.add_argument("--resume-changed", action="store_true",
                        help="with --resume: continue even though the dataset, model or options changed since the "
                             "run started (the changes are recorded in the run)")
    parser.add_argument("--no-step-up", action="store_true",
                        help="keep the plan's settings: never step up into measured headroom (our engine steps up "
                             "after its first steady steps when a larger setting fits and is >= 10%% faster)")
    parser.add_argument("--max-retries", type=int, default=5,
                        help="retries after OOM / divergence / kill / stall (default 5)")
    parser.add_argument("--stall-timeout", type=finite, default=600.0,
                        help="seconds without progress before the run is killed and retried (default 600); "
                             "loading adds time for the model's size, training allows ten usual steps")
    parser.add_argument("--verbose", action="store_true",
                        help="show the libraries' own warnings too (hidden by default: nothing to act on)")
    parser.add_argument("--save-state-every", type=finite, default=60.0,
                        help="seconds between cheap state saves, the most work an OS kill can lose (default 60)")
    parser.add_argument("--skip-doctor", action="store_true",
                        help="start even when `autotune doctor` finds errors in the dataset (not recommended)")
    parser.add_argument("--memory-limit", type=finite,
                        help="CPU only: cap the trainer's address space at this many MiB (a real, catchable OOM)")
    parser.add_argument("--engine", metavar="sd-scripts=PATH|musubi-tuner=PATH",
                        help="train with your own sd-scripts (a checkout, or a lora-scripts / kohya_ss folder) or, "
                             "for Qwen-Image / FLUX.2 / Wan / Z-Image, your musubi-tuner checkout, under the same "
                             "watchdog, instead of autotune's engine")
    parser.add_argument("--python", help="with --engine: the Python that runs it (default: the venv beside it, "
                                         "else this Python)")


MIN_MEMORY_LIMIT_MIB = 2048  # Python, torch and the engine's imports alone map about 1 GiB of address space


def check_options(args: argparse.Namespace) -> None:
    """The watchdog's own options: a one-line UserError naming the option, before anything is read or written."""
    if args.max_retries < 0:
        raise UserError(f"--max-retries {args.max_retries}: must be 0 or more (0: never retry)")
    if not args.stall_timeout > 0:
        raise UserError(f"--stall-timeout {args.stall_timeout:g}: must be a positive number of seconds, "
                        "e.g. 600 (the default)")
    if not args.save_state_every > 0:
        raise UserError(f"--save-state-every {args.save_state_every:g}: must be a positive number of seconds, "
                        "e.g. 60 (the default)")
    if args.dataset_config and not args.config:  # the plan writes its own dataset.toml: it would be ignored
        raise UserError(f"--dataset-config {args.dataset_config}: needs --config (the training config it belongs "
                        "to); without --config autotune plans the dataset itself")
    if getattr(args, "python", None) and not getattr(args, "engine", None):
        raise UserError(f"--python {args.python}: only with --engine (autotune's own engine runs in this Python)")
    if args.memory_limit is not None and not args.memory_limit >= MIN_MEMORY_LIMIT_MIB:
        raise UserError(f"--memory-limit {args.memory_limit:g}: too small to start the trainer (MiB of address "
                        f"space; at least {MIN_MEMORY_LIMIT_MIB}, e.g. --memory-limit 16000)")
    if getattr(args, "emulate_card", None) is not None and getattr(args, "engine", None):
        raise UserError("--emulate-card: only autotune's own engine counts its tensors on an emulated card; another "
                        "trainer counts none: drop --engine or --emulate-card")


def dataset_folder(path: str, what: str = "dataset folder") -> Path:
    """``path`` made absolute; a symlink loop or a path the OS cannot resolve is a one-line UserError."""
    try:
        return Path(path).expanduser().resolve(strict=False)
    except (OSError, RuntimeError) as error:  # RuntimeError: Python < 3.13 reports a symlink loop so
        raise UserError(f"{what} {path}: cannot resolve the path ({error}); give a real folder") from None


# ---------------------------------------------------------------- dataset check


def check_dataset(folder: Path, frames: int | None = None) -> DatasetScan:
    """Basic checks before anything heavy, with the planner's own scan (``sd_scripts_compat.facts.dataset_scan``):
    the folder exists and holds images (with ``frames`` > 1: videos, a clip dataset's), in N_name subfolders or
    directly in it (one subset, 1 repeat).

    Returns the ``DatasetScan``. A missing folder or one without them is a one-line UserError.
    """
    from sd_scripts_compat.facts.dataset_scan import (
        IMAGE_EXTENSIONS,
        VIDEO_EXTENSIONS,
        require_images,
        scan_dataset_folder,
    )

    media = VIDEO_EXTENSIONS if (frames or 1) > 1 else IMAGE_EXTENSIONS
    return require_images(scan_dataset_folder(folder, media=media), media)


def check_folder_convention(args: argparse.Namespace, scan: DatasetScan) -> None:
    """``--config`` without ``--dataset-config`` trains on the folder as sd-scripts' ``train_data_dir``,
    which reads only N_name subfolders: images directly in the folder are a one-line UserError there."""
    if args.config and not args.dataset_config and not args.resume and scan.top_level:
        if scan.subsets[0].class_tokens is not None or scan.subsets[0].num_repeats > 1:
            raise UserError(f"{scan.root} is itself an N_name folder, but --config without --dataset-config trains on "
                            "it as train_data_dir, which holds N_name folders: pass its parent "
                            f"{scan.root.parent} instead (or give --dataset-config)")
        raise UserError(f"{scan.root}: the images lie directly in the folder, but --config without "
                        "--dataset-config trains on it as train_data_dir, which reads only N_name subfolders; "
                        f"move them into e.g. {scan.root / '10_mychar'}, or give --dataset-config")


def describe_scan(scan: DatasetScan) -> str:
    """One line: each subset with its image count (and every skipped folder, with why)."""
    parts = [f"{'images directly in the folder' if scan.top_level else s.folder.name} ({s.num_images} images"
             f"{f', {s.num_repeats} repeats' if s.num_repeats > 1 else ''}"
             f"{f', class tokens {s.class_tokens!r}' if s.class_tokens else ''})" for s in scan.subsets]
    return ", ".join(parts) + "".join(f"; {warning}" for warning in scan.warnings)


# ---------------------------------------------------------------- output folder


def _prepare_output(out: Path, resume: bool) -> None:
    from autotune.recovery.attempt import read_json
    from sd_scripts_compat.facts.contract import newest_state

    if resume:
        if not (out / RUN_STATE).is_file():
            raise UserError(f"{out}: no interrupted autotune run here ({RUN_STATE} missing); "
                            "run without --resume, or pass the --out of the run to continue")
        if not isinstance(read_json(out / RUN_STATE), dict):
            raise UserError(f"{out / RUN_STATE}: unreadable (not the JSON autotune run writes); the run cannot be "
                            "continued: start a new one with another --out")
        if not (out / CONFIG).is_file():
            raise UserError(f"{out}: the interrupted run's config.toml is missing; the run cannot be continued: "
                            "start a new one with another --out")
        trainer = live_trainer(out)
        if trainer is not None:
            raise UserError(f"{out}: the interrupted run's trainer (PID {trainer}) is still running (saving its "
                            "state); wait for it to end, then --resume")
        return
    if (out / RUN_STATE).is_file() or newest_state(out / STATE_DIR) is not None or newest_state(out) is not None:
        raise UserError(f"{out}: holds an earlier run; continue it with --resume, or choose another --out")


def live_trainer(out: Path) -> int | None:
    """The PID of this run's trainer when it is still alive (its command line names ``out``), else None."""
    try:
        pid = int((out / TRAINER_PID).read_text(encoding="ascii").strip())
        argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[-1].split()[0]
    except (OSError, ValueError):
        return None
    return pid if state != "Z" and str(out).encode() in argv else None


# ---------------------------------------------------------------- run


def start_run(args: argparse.Namespace) -> int:
    from autotune.launch.out_lock import locked_output
    from autotune.launch.plan_options import accept_pickle

    check_options(args)
    accept_pickle(args, "run")
    dataset_dir = dataset_folder(args.dataset)
    family = run_family(args)  # detected once: everything after takes the FamilySpec
    check_engine(args, family)  # a family this engine does not train, a wrong PATH: said now, not after planning
    scan = check_dataset(dataset_dir, getattr(args, "frames", None))
    check_folder_convention(args, scan)
    if args.resolution is not None and not args.config:  # the plan's own rule, said before the doctor's checks
        from autotune.planning.request import validate_resolution

        validate_resolution(args.resolution, family)
    out = _output_folder(args, dataset_dir, family)
    finished = _finished_line(out) if args.resume else None
    if finished is not None:  # training it again would write over its LoRA: nothing to continue
        print(f"{out}: this run has finished ({finished}); --resume changes nothing. Train again with another "
              "--out, or with more --steps into a new folder")
        return 0
    if not args.skip_doctor:  # a one-line UserError on errors, before anything is written
        from autotune.doctor import check_before_training

        print("\n".join(check_before_training(dataset_dir, family=family, **_doctor_options(args, family))))
    if not args.resume and out.is_dir() and not run_traces(out):  # a run's own folder: _prepare_output says
        refuse_foreign_configs(out)  # the user's configs are never written over
    before = _entries(out)
    with locked_output(out):  # one run per --out: a second one is told the first's PID
        try:
            _prepare_output(out, args.resume)
            return _supervised(args, out, dataset_dir, scan, family)
        except UserError:
            if not args.resume:
                _remove_failed_start(out, before)
            raise


def _finished_line(out: Path) -> str | None:
    """The watchdog's last word on the run in ``out`` when that is "done" (its line); None otherwise."""
    from autotune.recovery.decisions import last_decision

    record = last_decision(out)
    return str(record.get("text", "")) if record is not None and record.get("event") == "done" else None


def _output_folder(args: argparse.Namespace, dataset_dir: Path, family: FamilySpec) -> Path:
    """``--out``, the run that ``--resume RUN`` names (its folder or any file in it), or the default folder."""
    if isinstance(args.resume, str):
        root = run_root(Path(args.resume))
        if root is None:
            raise UserError(f"--resume {args.resume}: not in an autotune run folder (no {RUN_STATE} or {CONFIG} "
                            "there or above); give the folder of the run to continue, or a file in it")
        if args.out and dataset_folder(args.out, "--out") != root:
            raise UserError(f"--resume {args.resume} is in the run {root}, but --out is {args.out}; give one of them")
        return root
    out = dataset_folder(args.out, "--out") if args.out else default_out(dataset_dir, family)
    refuse_out_in_dataset(out, dataset_dir, "--out" if args.out else "the run's folder (--out)")
    return out


def _doctor_options(args: argparse.Namespace, family: FamilySpec) -> dict[str, Any]:
    """What the doctor checks for: the settings --config (+ --dataset-config) will train with, else the pins."""
    if not args.config:
        return {"resolution": args.resolution, **({"frames": args.frames} if getattr(args, "frames", None) else {})}
    from autotune.doctor.diagnose import options_from_config

    return options_from_config(args.config, args.dataset_config, family=family, dataset_dir=args.dataset)


def _checked_fingerprint(args: argparse.Namespace, out: Path, dataset_dir: Path) -> dict[str, Any]:
    """What to keep in autotune_run.json about the run's inputs: a new run's fingerprint; on --resume, the one it
    started with, after refusing (one line listing them) a resume whose inputs changed, unless --resume-changed."""
    from autotune.launch.fingerprint import changes, run_fingerprint
    from autotune.recovery.attempt import read_json

    now = run_fingerprint(args, dataset_dir)
    if not args.resume:
        return {"fingerprint": now}
    saved = read_json(out / RUN_STATE) or {}
    if not isinstance(saved.get("fingerprint"), dict):  # a run started before fingerprints: nothing to compare
        return {}
    changed = changes(saved["fingerprint"], now)
    kept = {"fingerprint": saved["fingerprint"], "resumed_changed": list(saved.get("resumed_changed") or [])}
    if changed and not args.resume_changed:
        raise UserError(f"{out}: changed since this run started: {'; '.join(changed)}; --resume would continue "
                        "another run: start a new one with another --out, or pass --resume-changed to continue")
    if changed:
        print(f"resuming although changed since the run started: {'; '.join(changed)}")
        kept["resumed_changed"] += changed
    return kept


def _supervised(args: argparse.Namespace, out: Path, dataset_dir: Path, scan: DatasetScan, family: FamilySpec) -> int:
    """Plan or copy the configs into ``out``, then train under the watchdog; the exit code, or a UserError."""
    from autotune.hardware.probe import probe_system

    print(f"dataset {dataset_dir}: {describe_scan(scan)}")
    started = _checked_fingerprint(args, out, dataset_dir)
    probe = probe_system(out, use_torch=False)
    cuda = probe.accelerator == "cuda"
    if args.memory_limit and cuda:
        raise UserError("--memory-limit caps CPU address space and would break CUDA; drop it on a GPU machine")
    kind, _ = parse_engine(getattr(args, "engine", None))
    if getattr(args, "emulate_card", None) is not None and cuda:
        raise UserError("--emulate-card emulates a card on the CPU; this machine trains on its GPU: drop it")
    return _supervise_job(args, out, probe, kind.job(args, out, scan, probe, started, family), family,
                          ours=kind.own_measurements)


def _supervise_job(args: argparse.Namespace, out: Path, probe: SystemProbe, job: Job, family: FamilySpec,
                   ours: bool) -> int:
    """Train ``job`` under the watchdog; its exit code, or a UserError."""
    import json
    import signal

    from autotune.recovery.watchdog import supervise
    from sd_scripts_compat.facts.contract import MONITOR_FILE, DiskFullError, Outcome

    with _watching_for_slowdowns(out / EVENTS_DIR / MONITOR_FILE):
        result = supervise(job)
    if ours:  # the store keeps our engine's figures (another trainer's are not comparable)
        remember_attempts(result.attempts, probe, family, job.limits.budget_mib,
                          contended=_contended(out), predict=job.predict,
                          emulated_card=getattr(args, "emulate_card", None))
    if args.json:
        print(json.dumps({"ok": result.ok, "outcome": result.outcome, "message": result.message,
                          "output_file": result.output_file, "final_settings": result.final_settings.to_event(),
                          "retries": result.retries, "output_dir": str(out)}, indent=2, default=str))
    if result.ok:
        retries = len(result.retries)
        print(f"\nLoRA: {result.output_file}\nsettings that worked: {out / FINAL_CONFIG}"
              f"{f' ({retries} retries, see {out / DECISIONS_LOG})' if retries else ''}")
        if not args.json:
            _print_report(out)
        return 0
    if result.outcome is Outcome.USER_ERROR:
        raise UserError(result.message.split(": error: ", 1)[-1])
    if result.outcome is Outcome.DISK_FULL:
        raise DiskFullError(result.message.split(": error: ", 1)[-1])
    if result.outcome is Outcome.BAD_DATA:
        raise BadWeights(result.message.split(": error: ", 1)[-1])
    if result.outcome is Outcome.INTERRUPTED:
        last = result.attempts[-1] if result.attempts else None
        print(f"interrupted; continue with: autotune run {shlex.join([args.dataset, '--model', args.model])} "
              f"--resume {shlex.quote(str(out))}", file=sys.stderr)
        terminated = last is not None and (last.stop_signal == signal.SIGTERM or last.returncode == 143)
        return 143 if terminated else 130
    print(f"autotune run: {result.message}", file=sys.stderr)
    return 1


def remember_attempts(attempts: list[Any], probe: SystemProbe, family: FamilySpec, budget_mib: float | None,
                      contended: str | None = None, predict: Callable[[TrainSettings], float] | None = None,
                      emulated_card: float | None = None) -> None:
    """Each attempt that finished or ran out of memory goes into this machine's measurement store, so the next
    plan predicts from it (``autotune.measure``); a store that cannot be written costs a warning, not the run.
    A run that shared the CPU with other work (``contended``: why) keeps its speed out: the plan would learn the
    other work's share as this machine's speed; its memory figures and out-of-memory attempts still count.
    ``predict``: the run's memory model (MiB), whose figure each record keeps beside the measured one.
    ``emulated_card``: the run trained on a card of that many MiB emulated on the CPU, a device of its own."""
    from dataclasses import replace

    from autotune.measure.store import (
        device_key,
        emulated_device_key,
        from_done_event,
        from_oom_event,
        record_measurements,
    )

    device = device_key(probe) if emulated_card is None else emulated_device_key(probe)
    records: list[Any] = []
    if contended:
        print(f"this run's speed is not kept for future plans: {contended}")
    for attempt in attempts:
        if attempt.done_event:
            record = from_done_event(attempt.done_event, device=device, family=family, source="run")
            records.append(replace(record, seconds_per_step=None, steps=0) if record and contended else record)
        elif attempt.oom_event:
            records.append(from_oom_event(attempt.oom_event, device=device, family=family, source="run",
                                          budget_mib=budget_mib))
    records = [_with_prediction(r, predict) for r in records if r is not None]
    if not records:
        return
    try:
        record_measurements(records)
    except OSError as error:
        print(f"warning: could not store this run's measurements ({error}); plans will not learn from it",
              file=sys.stderr)


def _with_prediction(record: Measurement, predict: Callable[[TrainSettings], float] | None) -> Measurement:
    from dataclasses import replace

    from sd_scripts_compat.facts.settings import TrainSettings

    if predict is None:
        return record
    try:
        return replace(record, predicted_mib=round(predict(TrainSettings.from_event(record.settings)), 1))
    except (TypeError, ValueError, KeyError):  # settings of another version: the measured figures still count
        return record


def _contended(out: Path) -> str | None:
    """Why the finished run's speed does not represent this machine (``autotune.report.analysis.contention``)."""
    from autotune.report.analysis import contention
    from autotune.report.load import load_run

    if not (out / EVENTS_DIR).is_dir():
        return None
    try:
        return contention(load_run(out))
    except UserError:
        return None


def _watching_for_slowdowns(monitor_file: Path) -> contextlib.AbstractContextManager[None]:
    """A thread that reads the engine's monitor file while it trains and prints a warning line when the run
    spills into shared memory, swaps or throttles (``autotune.report.detector``)."""
    import contextlib
    import threading

    from autotune.report.detector import watch

    @contextlib.contextmanager
    def watching() -> Iterator[None]:
        stop = threading.Event()
        thread = threading.Thread(target=watch, args=(monitor_file, lambda line: print(line, flush=True), stop),
                                  name="autotune-slow-run-detector", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(5)

    return watching()


def _print_report(out: Path) -> None:
    """The run's report (``autotune report``) after a finished run, and its HTML page in ``out``."""
    from autotune.report.run_report import report_for

    try:
        text, _ = report_for(out, html_path=out / REPORT_HTML)
    except UserError as error:  # nothing to report (another engine wrote no events): the run itself succeeded
        print(f"no report: {error}")
        return
    print(f"\n{text.rstrip()}\nreport page: {out / REPORT_HTML} (again with: autotune report {out})")


def run_family(args: argparse.Namespace) -> FamilySpec:
    """The model's ``FamilySpec``, detected once for the whole run (``--family`` states it where the file cannot;
    a pickle checkpoint is read only with ``--allow-pickle``)."""
    from sd_scripts_compat.models.detect import detect_family

    return detect_family(args.model, args.family, allow_pickle=bool(getattr(args, "allow_pickle", False)))


def _entries(folder: Path) -> set[str] | None:
    """The names in ``folder`` now (None: it does not exist yet)."""
    try:
        return {entry.name for entry in folder.iterdir()}
    except OSError:
        return None


def _remove_failed_start(out: Path, before: set[str] | None) -> None:
    """A run that failed before training saved anything leaves nothing behind (its error said everything),
    so the same ``--out`` is free for the next try: what this call wrote goes, what was there stays."""
    import shutil

    from sd_scripts_compat.facts.contract import newest_state

    if not out.is_dir() or newest_state(out) is not None or newest_state(out / STATE_DIR) is not None:
        return
    if before is None:
        shutil.rmtree(out, ignore_errors=True)
        return
    for entry in out.iterdir():
        if entry.name not in before:
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() and not entry.is_symlink() \
                else entry.unlink(missing_ok=True)
