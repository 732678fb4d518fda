"""Start a supervised training run: the one function ``autotune run``, the wizard and the web app call.

``start_run(args)`` checks the dataset, probes, plans (or copies the user's config), writes the configs into the
output folder and trains under the watchdog (``autotune.recovery``), which steps down after an OOM, rolls back
after a diverged loss and resumes from the last saved state; at the end it prints the run's report. ``args`` are
the options ``add_arguments`` declares (the same for every caller).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from autotune.launch.plan_options import finite
from autotune.layout import (
    CONFIG,
    DATASET_CONFIG,
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
from sd_scripts_compat.errors import BadWeights, UserError
from sd_scripts_compat.quiet import VERBOSE_ENV


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


def check_engine_trains(model: str, family: str | None, *, engine: str | None = None) -> None:
    """A family the chosen engine does not train is one line before planning: a musubi-tuner family under any
    engine; under ours (``engine`` None), one only sd-scripts trains (Lumina 2, HunyuanImage-2.1, Anima), naming
    sd-scripts' script and ``--engine``."""
    from sd_scripts_compat.models.detect import detect_family

    spec = detect_family(model, family)
    musubi = str(engine or "").startswith("musubi-tuner=")
    if spec.trainer == "musubi-tuner" and not musubi:
        raise UserError(f"{model}: {spec.description} is planned by lora-autotune but trained by musubi-tuner's "
                        f"{spec.kohya_script}; add --engine musubi-tuner=PATH (your musubi-tuner checkout), or "
                        "write its files with autotune plan --out DIR and run DIR/musubi_train.sh")
    if musubi and spec.trainer != "musubi-tuner":
        raise UserError(f"{model}: {spec.description} is not trained by musubi-tuner; drop --engine (autotune's "
                        "engine) or use --engine sd-scripts=PATH")
    if engine is None and not spec.trained_here:
        raise UserError(f"{model}: {spec.description} is planned by lora-autotune but trained by sd-scripts' "
                        f"{spec.kohya_script}; add --engine sd-scripts=PATH (your sd-scripts checkout), or write "
                        "the configs with autotune plan --out")


def dataset_folder(path: str, what: str = "dataset folder") -> Path:
    """``path`` made absolute; a symlink loop or a path the OS cannot resolve is a one-line UserError."""
    try:
        return Path(path).expanduser().resolve(strict=False)
    except (OSError, RuntimeError) as error:  # RuntimeError: Python < 3.13 reports a symlink loop so
        raise UserError(f"{what} {path}: cannot resolve the path ({error}); give a real folder") from None


# ---------------------------------------------------------------- dataset check


def check_dataset(folder: Path, frames: int | None = None) -> Any:
    """Basic checks before anything heavy, with the planner's own scan (``sd_scripts_compat.dataset.scan``):
    the folder exists and holds images (with ``frames`` > 1: videos, a clip dataset's), in N_name subfolders or
    directly in it (one subset, 1 repeat).

    Returns the ``DatasetScan``. A missing folder or one without them is a one-line UserError.
    """
    from sd_scripts_compat.dataset.scan import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS, require_images, scan_dataset_folder

    media = VIDEO_EXTENSIONS if (frames or 1) > 1 else IMAGE_EXTENSIONS
    return require_images(scan_dataset_folder(folder, media=media), media)


def check_folder_convention(args: argparse.Namespace, scan: Any) -> None:
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


def describe_scan(scan: Any) -> str:
    """One line: each subset with its image count (and every skipped folder, with why)."""
    parts = [f"{'images directly in the folder' if scan.top_level else s.folder.name} ({s.num_images} images"
             f"{f', {s.num_repeats} repeats' if s.num_repeats > 1 else ''}"
             f"{f', class tokens {s.class_tokens!r}' if s.class_tokens else ''})" for s in scan.subsets]
    return ", ".join(parts) + "".join(f"; {warning}" for warning in scan.warnings)


# ---------------------------------------------------------------- output folder


def _prepare_output(out: Path, resume: bool) -> None:
    from autotune.recovery.attempt import read_json
    from sd_scripts_compat.contract import newest_state

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


def address_space_limit(limit_mib: float) -> Any:
    """A ``preexec_fn`` that caps the child's address space, so an oversized allocation fails inside
    torch (``DefaultCPUAllocator: can't allocate memory``) instead of summoning the OS OOM killer."""
    import resource

    limit = int(limit_mib * 2**20)

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return apply


# ---------------------------------------------------------------- run


def start_run(args: argparse.Namespace) -> int:
    from autotune.launch.out_lock import locked_output
    from autotune.launch.plan_options import accept_pickle

    check_options(args)
    accept_pickle(args, "run")
    dataset_dir = dataset_folder(args.dataset)
    if str(getattr(args, "engine", None) or "").startswith("musubi-tuner="):
        check_engine_trains(args.model, args.family, engine=args.engine)
        from autotune.launch.musubi_run import early_check as musubi_check

        musubi_check(args)
    elif getattr(args, "engine", None):  # a wrong PATH is said now, not after planning
        from autotune.recovery.sd_scripts import early_check

        early_check(args.engine, args.python, args.model)
        if args.model and not str(args.model).startswith("builtin:"):
            check_engine_trains(args.model, args.family, engine=args.engine)
    elif args.model:
        check_engine_trains(args.model, args.family)
    scan = check_dataset(dataset_dir, getattr(args, "frames", None))
    check_folder_convention(args, scan)
    if args.resolution is not None and not args.config:  # the plan's own rule, said before the doctor's checks
        from autotune.planning.request import validate_resolution
        from sd_scripts_compat.models.detect import detect_family

        validate_resolution(args.resolution, detect_family(args.model, args.family))
    if not args.skip_doctor:  # a one-line UserError on errors, before anything is written
        from autotune.doctor import check_before_training

        print("\n".join(check_before_training(dataset_dir, model=args.model, family=args.family,
                                               **_doctor_options(args))))
    out = _output_folder(args, dataset_dir)
    if not args.resume and out.is_dir() and not run_traces(out):  # a run's own folder: _prepare_output says
        refuse_foreign_configs(out)  # the user's configs are never written over
    before = _entries(out)
    with locked_output(out):  # one run per --out: a second one is told the first's PID
        try:
            _prepare_output(out, args.resume)
            return _supervised(args, out, dataset_dir, scan)
        except UserError:
            if not args.resume:
                _remove_failed_start(out, before)
            raise


def _output_folder(args: argparse.Namespace, dataset_dir: Path) -> Path:
    """``--out``, the run that ``--resume RUN`` names (its folder or any file in it), or the default folder."""
    if isinstance(args.resume, str):
        root = run_root(Path(args.resume))
        if root is None:
            raise UserError(f"--resume {args.resume}: not in an autotune run folder (no {RUN_STATE} or {CONFIG} "
                            "there or above); give the folder of the run to continue, or a file in it")
        if args.out and dataset_folder(args.out, "--out") != root:
            raise UserError(f"--resume {args.resume} is in the run {root}, but --out is {args.out}; give one of them")
        return root
    out = dataset_folder(args.out, "--out") if args.out else default_out(dataset_dir, _family_name(args))
    refuse_out_in_dataset(out, dataset_dir, "--out" if args.out else "the run's folder (--out)")
    return out


def _doctor_options(args: argparse.Namespace) -> dict[str, Any]:
    """What the doctor checks for: the settings --config (+ --dataset-config) will train with, else the pins."""
    if not args.config:
        return {"resolution": args.resolution, **({"frames": args.frames} if getattr(args, "frames", None) else {})}
    from autotune.doctor.diagnose import options_from_config

    return options_from_config(args.config, args.dataset_config, model=args.model, family=args.family,
                               dataset_dir=args.dataset)


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


def _supervised(args: argparse.Namespace, out: Path, dataset_dir: Path, scan: Any) -> int:
    """Plan or copy the configs into ``out``, then train under the watchdog; the exit code, or a UserError."""
    from autotune.hardware.probe import probe_system

    print(f"dataset {dataset_dir}: {describe_scan(scan)}")
    started = _checked_fingerprint(args, out, dataset_dir)
    probe = probe_system(out, use_torch=False)
    cuda = probe.accelerator == "cuda"
    if args.memory_limit and cuda:
        raise UserError("--memory-limit caps CPU address space and would break CUDA; drop it on a GPU machine")
    if str(getattr(args, "engine", None) or "").startswith("musubi-tuner="):
        from autotune.launch.musubi_run import musubi_job

        return _supervise_job(args, out, probe, musubi_job(args, out, probe, started), ours=False)
    return _supervise_job(args, out, probe, _job(args, out, scan, probe, started),
                          ours=not getattr(args, "engine", None))


def _job(args: argparse.Namespace, out: Path, scan: Any, probe: Any, started: dict[str, Any]) -> Any:
    """The watchdog's job for our engine or the user's sd-scripts: configs planned or copied into ``out``."""
    from autotune.recovery.attempt import read_json
    from autotune.recovery.engine import CompatEngine
    from autotune.recovery.watchdog import Job

    cuda = probe.accelerator == "cuda"
    config_path, dataset_path, plan = _configs(args, out, scan)
    usable_mib = _usable_mib(plan)
    family, resolved = _resolve(config_path, dataset_path, args)
    settings = resolved.settings
    prior: list[dict[str, Any]] = []
    if args.resume:
        saved = read_json(out / RUN_STATE) or {}
        usable_mib = saved.get("usable_mib")
        if isinstance(saved.get("settings"), dict):
            settings = _saved_settings(saved["settings"], out)
        prior = list(saved.get("retries") or [])
    limits = _limits(probe, family, resolved, args, cuda, usable_mib)
    train_output = Path(resolved.config.output_dir or out)
    ours = not getattr(args, "engine", None)
    if ours:
        engine: Any = CompatEngine.for_module(family.engine_module, save_state_every_s=args.save_state_every)
        states_at: Path | None = out / STATE_DIR
    else:
        from autotune.recovery.sd_scripts import prepare

        engine = prepare(args.engine, args.python, family=family, config=config_path, output_dir=out,
                         states_dir=train_output, save_every_s=args.save_state_every, env=os.environ,
                         planned_it_per_s=plan.prediction.it_per_s if plan and plan.prediction else None)
        states_at = None  # sd-scripts keeps its states beside the LoRA (it has no option for another folder)
    job = Job(
        config_path=config_path, output_dir=out, settings=settings, limits=limits,
        predict=_predictor(family, resolved, cuda), dataset_config_path=dataset_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **({VERBOSE_ENV: "1"} if getattr(args, "verbose", False) else {})},
        cuda=cuda, max_retries=args.max_retries,
        stall_timeout_s=args.stall_timeout, resume=bool(args.resume),
        preexec_fn=address_space_limit(args.memory_limit) if args.memory_limit else None, prior_retries=prior,
        train_output_dir=train_output, states_at=states_at, extra_state={"usable_mib": limits.budget_mib, **started},
        budget_kind="address_space" if args.memory_limit else ("device" if cuda else "ram"),
        engine=engine,
        stability=_stability_limits(probe, cuda),
    )
    return job


def _supervise_job(args: argparse.Namespace, out: Path, probe: Any, job: Any, ours: bool) -> int:
    """Train ``job`` under the watchdog; its exit code, or a UserError."""
    import json
    import signal

    from autotune.recovery.watchdog import supervise
    from sd_scripts_compat.contract import MONITOR_FILE, DiskFullError, Outcome

    with _watching_for_slowdowns(out / EVENTS_DIR / MONITOR_FILE):
        result = supervise(job)
    if ours:  # the store keeps our engine's figures (another trainer's are not comparable)
        remember_attempts(result.attempts, probe, _family_name(args), job.limits.budget_mib,
                          contended=_contended(out))
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


def remember_attempts(attempts: list[Any], probe: Any, family: str, budget_mib: float | None,
                      contended: str | None = None) -> None:
    """Each attempt that finished or ran out of memory goes into this machine's measurement store, so the next
    plan predicts from it (``autotune.measure``); a store that cannot be written costs a warning, not the run.
    A run that shared the CPU with other work (``contended``: why) keeps its speed out: the plan would learn the
    other work's share as this machine's speed; its out-of-memory attempts still count."""
    from autotune.measure.store import device_key, from_done_event, from_oom_event, record_measurements

    device = device_key(probe)
    records = []
    if contended:
        print(f"this run's speed is not kept for future plans: {contended}")
    for attempt in attempts:
        if attempt.done_event and not contended:
            records.append(from_done_event(attempt.done_event, device=device, family=family, source="run"))
        elif attempt.oom_event:
            records.append(from_oom_event(attempt.oom_event, device=device, family=family, source="run",
                                          budget_mib=budget_mib))
    records = [r for r in records if r is not None]
    if not records:
        return
    try:
        record_measurements(records)
    except OSError as error:
        print(f"warning: could not store this run's measurements ({error}); plans will not learn from it",
              file=sys.stderr)


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


def _watching_for_slowdowns(monitor_file: Path) -> Any:
    """A thread that reads the engine's monitor file while it trains and prints a warning line when the run
    spills into shared memory, swaps or throttles (``autotune.report.detector``)."""
    import contextlib
    import threading

    from autotune.report.detector import watch

    @contextlib.contextmanager
    def watching() -> Any:
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


def _family_name(args: argparse.Namespace) -> str:
    from sd_scripts_compat.models.detect import detect_family

    return detect_family(args.model, args.family, allow_pickle=bool(getattr(args, "allow_pickle", False))).name


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

    from sd_scripts_compat.contract import newest_state

    if not out.is_dir() or newest_state(out) is not None or newest_state(out / STATE_DIR) is not None:
        return
    if before is None:
        shutil.rmtree(out, ignore_errors=True)
        return
    for entry in out.iterdir():
        if entry.name not in before:
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() and not entry.is_symlink() \
                else entry.unlink(missing_ok=True)


def _configs(args: argparse.Namespace, out: Path, scan: Any) -> tuple[Path, Path | None, Any]:
    """config.toml (+ dataset.toml) in ``out``: planned, copied from ``--config``, or kept from the run
    being resumed. Returns their paths and the plan, when there is one (its predictions go on to the watchdog:
    the step-down budget, a wrapped trainer's first save interval)."""
    config_path, dataset_path = out / CONFIG, out / DATASET_CONFIG
    if args.resume:
        return config_path, dataset_path if dataset_path.is_file() else None, None
    if not args.config:
        from autotune.launch.plan_into import plan_into

        return plan_into(args, out)
    return config_path, _copy_user_configs(args, out, scan), None


def _copy_user_configs(args: argparse.Namespace, out: Path, scan: Any) -> Path | None:
    """Copy ``--config`` (and ``--dataset-config``) into ``out`` with the model and the data set.

    The config's own ``output_dir`` is honoured; without one, LoRA files go to ``out`` and the user is told
    so. Returns the dataset config's path in ``out`` (None: the folder convention, which
    needs N_name subfolders: sd-scripts' ``train_data_dir`` does not read images directly in the folder).
    """
    from sd_scripts_compat.config.kohya_toml import flat_values, read_toml, set_config_values, write_toml

    dataset_dir = scan.root
    user = Path(args.config)
    document = read_toml(user)
    forced: dict[str, Any] = {"pretrained_model_name_or_path": args.model}
    if args.allow_pickle:
        forced["allow_pickle"] = True
    given_output = flat_values(document).get("output_dir")
    if given_output:
        print(f"LoRA files go to {Path(given_output).resolve()} (output_dir of {user})")
    else:
        forced["output_dir"] = str(out)
        print(f"{user} sets no output_dir: LoRA files go to {out}")
    dataset_path: Path | None = None
    if args.dataset_config:
        dataset_path = out / DATASET_CONFIG
        write_toml(dataset_path, read_toml(args.dataset_config, "dataset config"),
                   f"# from {args.dataset_config} (autotune run)\n")
        forced["dataset_config"] = str(dataset_path)
    else:
        forced["train_data_dir"] = str(dataset_dir)
    write_toml(out / CONFIG, set_config_values(document, forced), f"# from {user} (autotune run)\n")
    return dataset_path


def _resolve(config_path: Path, dataset_path: Path | None, args: argparse.Namespace) -> tuple[Any, Any]:
    """The family and the run as the engine will resolve it (its own reader, kohya's precedence), refused now if
    the family's own rules refuse it (a swap count over its maximum), before anything loads."""
    from sd_scripts_compat.config.kohya_toml import flat_values, read_toml
    from sd_scripts_compat.config.settings_space import settings_from_files
    from sd_scripts_compat.models.detect import detect_family
    from sd_scripts_compat.training.block_swap import check_blocks_to_swap

    model = str(flat_values(read_toml(config_path)).get("pretrained_model_name_or_path") or args.model)
    family = detect_family(model, getattr(args, "family", None))
    resolved = settings_from_files(config_path, dataset_path, script=family.script,
                                   default_resolution=(family.resolution, family.resolution))
    check_blocks_to_swap(family, resolved.settings.blocks_to_swap)
    return family, resolved


def _saved_settings(values: dict[str, Any], out: Path) -> Any:
    from sd_scripts_compat.config.settings import TrainSettings

    try:
        return TrainSettings.from_event(values)
    except (ValueError, TypeError) as error:
        raise UserError(f"{out}: the saved run state is from another version ({error}); "
                        "start a new run with another --out") from None


def _limits(probe: Any, family: Any, resolved: Any, args: argparse.Namespace, cuda: bool,
            usable_mib: float | None) -> Any:
    """What the ladder may do on this machine, and the memory it must fit in (MiB).

    The budget is the plan's usable VRAM when there is a plan, else the probed card's, else (CPU) the
    address-space cap or the available RAM.
    """
    from autotune.recovery.ladder import LadderLimits

    gpu = next((g for g in probe.gpus if g.backend == "cuda"), None) if cuda else None
    if args.memory_limit:
        budget = args.memory_limit
    elif usable_mib:
        budget = usable_mib
    elif args.vram:
        budget = min(args.vram) * 1024
    elif gpu is not None and gpu.vram_total_bytes:
        budget = (gpu.vram_total_bytes - max(gpu.vram_used_bytes or 0, gpu.other_processes_vram_bytes or 0)) / 2**20
    else:
        budget = probe.memory.ram_available_bytes / 2**20
    # the rung would change nothing when the engine already caches the frozen text encoder's outputs
    te_cache_allowed = not _captions_randomized(resolved) and not _engine_caches_text(resolved)
    return LadderLimits.for_family(family, budget, fp8_supported=bool(gpu and gpu.fp8),
                                   te_cache_allowed=te_cache_allowed)


def _stability_limits(probe: Any, cuda: bool) -> Any:
    """The stability ladder may move fp16 to bf16 only on a card that computes in bf16."""
    from autotune.recovery.stability import StabilityLimits

    gpu = next((g for g in probe.gpus if g.backend == "cuda"), None) if cuda else None
    return StabilityLimits(bf16_supported=bool(gpu and gpu.bf16))


def _captions_randomized(resolved: Any) -> bool:
    """A caption option (shuffle, dropout, warm-up) on any subset, wherever the dataset.toml set it."""
    from sd_scripts_compat.dataset.captions import caption_is_deterministic

    return any(caption_is_deterministic(subset) is not None for subset in resolved.dataset.subsets)


def _engine_caches_text(resolved: Any) -> bool:
    """Our engine encodes fixed captions once when no text-encoder LoRA trains (UNet-only)."""
    return bool(resolved.config.network_train_unet_only) and not _captions_randomized(resolved)


def _predictor(family: Any, resolved: Any, cuda: bool) -> Any:
    from autotune.recovery.ladder import memory_predictor

    return memory_predictor(family.name, text_encoder_outputs_cached=_engine_caches_text(resolved), cuda=cuda)


def _usable_mib(plan: Any) -> float | None:
    """A GPU plan's usable VRAM is the step-down budget; a CPU plan (fp32 or bf16) leaves it to the probed RAM."""
    if plan is None or not plan.prediction or not plan.settings or plan.device == "CPU":
        return None
    return plan.prediction.usable_bytes / 2**20
