"""Measure training speed and memory on this machine: short real runs of the engine, one per settings point.

    autotune bench --model builtin:tiny-sd15                      # the plan's settings, 6 timed steps
    autotune bench DATASET --model M --sweep batch=1,2,4,8        # one run per micro-batch
    autotune bench --model M --config config.toml --steps 10 --json
    autotune bench --model M --sweep precision=no,bf16 --sweep resolution=256,512

Each point trains `--warmup` untimed steps (default 6), then `--steps` timed ones, in its own engine
process, and reports it/s (from the median timed step), images/s, peak memory (CUDA max allocated /
reserved; on a CPU the peak resident memory) and, where the engine writes one, the per-phase time
breakdown; the fastest point that fits is marked. Sweep keys: batch (the effective batch is kept:
accumulation follows), resolution, rank, checkpointing (off,on), precision (no,fp16,bf16), optimizer, compile
(off,on: each repeated block compiled with inductor; or a dynamo backend's name). A compiled point's compile time
is printed and stored beside its step time: plans compile only where the saving over their steps exceeds it.
The figures are stored for this device (see `autotune plan`: plans use them) unless
`--no-store`. Without DATASET a small synthetic dataset is used.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from autotune.launch.arg_types import finite
from sd_scripts_compat.facts.contract import Outcome
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import FamilySpec

ENGINE_WARMUP_STEPS = 2  # the engine's TIMING_WARMUP_STEPS: done.json leaves the first two steps out of its timing


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from autotune.launch import plan_options as plan_command

    plan_command.add_arguments(parser, dataset_required=False, bench=True)  # --keep DIR keeps its files
    parser.add_argument("--config", help="bench this kohya config.toml instead of a plan's settings")
    parser.add_argument("--dataset-config", help="with --config: a kohya dataset.toml to use")
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps per point (default 6)")
    parser.add_argument("--warmup", type=int, default=6,
                        help="untimed steps first (default 6; at least 2): each new bucket shape's first step "
                             "builds kernels and runs slow")
    parser.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2",
                        help="measure each value (repeat for a grid): batch, resolution, rank, checkpointing, "
                             "precision, optimizer, compile (off,on or a dynamo backend)")
    parser.add_argument("--no-store", action="store_true",
                        help="do not keep the figures for this machine's plans")
    parser.add_argument("--keep", metavar="DIR", help="run in DIR and keep its configs and logs (default: a "
                                                      "temporary folder, removed)")
    parser.add_argument("--memory-limit", type=finite,
                        help="CPU only: cap each run's address space at this many MiB (a real, catchable OOM)")
    parser.add_argument("--stall-timeout", type=finite, default=600.0,
                        help="seconds without progress before a point is killed (default 600)")


def check_options(args: argparse.Namespace) -> None:
    if args.steps < 1:
        raise UserError(f"--steps {args.steps}: must be 1 or more timed steps")
    if args.warmup < ENGINE_WARMUP_STEPS:
        raise UserError(f"--warmup {args.warmup}: at least {ENGINE_WARMUP_STEPS} (the engine's own untimed steps)")
    if args.config and not Path(args.config).is_file():
        raise UserError(f"--config {args.config}: no such file")
    if args.dataset_config and not args.config:
        raise UserError("--dataset-config goes with --config (a plan writes its own dataset.toml)")
    if args.dataset and not Path(args.dataset).is_dir():
        raise UserError(f"dataset {args.dataset}: no such folder; give a folder of N_name image subfolders, "
                        "or none for a synthetic one")
    if not args.stall_timeout > 0:
        raise UserError(f"--stall-timeout {args.stall_timeout:g}: must be a positive number of seconds")
    from autotune.launch.run import MIN_MEMORY_LIMIT_MIB

    if args.memory_limit is not None and not args.memory_limit >= MIN_MEMORY_LIMIT_MIB:
        raise UserError(f"--memory-limit {args.memory_limit:g}: at least {MIN_MEMORY_LIMIT_MIB} MiB")


def synthetic_dataset(folder: Path, side: int, count: int = 8) -> Path:
    """``count`` smooth gradient images of ``side`` px with captions, in one ``N_name`` folder: enough for a
    bench's batches, and as large as the largest resolution benched (buckets never upscale)."""
    import numpy as np
    from PIL import Image

    subset = folder / "4_bench"
    subset.mkdir(parents=True, exist_ok=True)
    ramp = np.linspace(0, 255, side, dtype=np.float32)
    for i in range(count):
        rgb = np.stack([np.add.outer(ramp, ramp) / 2, np.add.outer(ramp[::-1], ramp) / 2,
                        np.full((side, side), 40.0 * i % 256)], axis=-1)
        Image.fromarray(rgb.astype(np.uint8)).save(subset / f"bench_{i:02d}.png")
        (subset / f"bench_{i:02d}.txt").write_text(f"a bench image, number {i}\n", encoding="utf-8")
    return folder


def _largest_side(args: argparse.Namespace, native: int) -> int:
    from autotune.launch.bench import parse_sweeps

    sides = [native, args.resolution or 0]
    for key, values in parse_sweeps(args.sweep):
        if key == "resolution":
            sides += [int(v) for v in values if v.isdigit()]
    return max(sides)


def base_files(args: argparse.Namespace, workdir: Path) -> tuple[Path, Path | None, Any, Any]:
    """The base config (+ dataset.toml), its settings and the family: planned, or the user's --config."""
    from autotune.planning.planner import plan_training
    from autotune.planning.toml_writer import write_plan_files
    from sd_scripts_compat.models.detect import detect_family

    family = detect_family(args.model, args.family)
    if args.dataset is None:
        args.dataset = str(synthetic_dataset(workdir / "dataset", _largest_side(args, family.resolution)))
    base_dir = workdir / "base"
    if args.config:
        return (*_user_config(args, base_dir), family)
    from autotune.launch.plan_options import build_request

    args.out = str(base_dir)
    plan = plan_training(build_request(args))
    if not plan.fits:
        raise UserError(f"{args.model}: {plan.message}")
    config, dataset = write_plan_files(plan, base_dir)
    return config, dataset, plan.settings, family


def _user_config(args: argparse.Namespace, base_dir: Path) -> tuple[Path, Path | None, Any]:
    from sd_scripts_compat.config.resolved_run import settings_from_files
    from sd_scripts_compat.facts.kohya_toml import read_toml, set_config_values, write_toml
    from sd_scripts_compat.models.detect import detect_family

    base_dir.mkdir(parents=True, exist_ok=True)
    forced: dict[str, Any] = {"pretrained_model_name_or_path": args.model}
    if args.allow_pickle:
        forced["allow_pickle"] = True
    dataset = None
    if args.dataset_config:
        dataset = base_dir / "dataset.toml"
        write_toml(dataset, read_toml(args.dataset_config, "dataset config"))
        forced["dataset_config"] = str(dataset)
    else:
        forced["train_data_dir"] = str(Path(args.dataset).resolve())
    config = base_dir / "config.toml"
    write_toml(config, set_config_values(read_toml(args.config), forced), f"# from {args.config} (autotune bench)\n")
    family = detect_family(args.model, args.family)
    resolved = settings_from_files(config, dataset, sdxl=family.is_sdxl,
                                   default_resolution=(family.resolution, family.resolution))
    return config, dataset, resolved.settings


def run(args: argparse.Namespace) -> int:
    from autotune.launch.bench import parse_sweeps
    from autotune.launch.plan_options import accept_pickle

    check_options(args)
    accept_pickle(args, "bench")
    parse_sweeps(args.sweep)  # a bad --sweep is said before anything runs
    if args.keep:
        workdir = Path(args.keep).expanduser().resolve()
        try:
            workdir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise UserError(f"--keep {args.keep}: cannot make that folder ({error.strerror}); give a folder "
                            "path") from None
        return _bench(args, workdir)
    with tempfile.TemporaryDirectory(prefix="autotune-bench-") as tmp:
        return _bench(args, Path(tmp))


def _bench(args: argparse.Namespace, workdir: Path) -> int:
    from autotune.hardware.probe import probe_system
    from autotune.launch.bench import BenchJob, engine_env, parse_sweeps, run_bench, sweep_points
    from autotune.measure.store import device_key
    from autotune.recovery.attempt import address_space_limit

    probe = probe_system(workdir, use_torch=False)
    cuda = probe.accelerator == "cuda"
    if args.memory_limit and cuda:
        raise UserError("--memory-limit caps CPU address space and would break CUDA; drop it on a GPU machine")
    config, dataset, base, family = base_files(args, workdir)
    points = sweep_points(base, parse_sweeps(args.sweep))
    job = BenchJob(config=config, dataset_config=dataset, base=base, engine_module=family.engine_module,
                   workdir=workdir, steps=args.steps, warmup=args.warmup, env=engine_env(), cuda=cuda,
                   stall_timeout_s=args.stall_timeout,
                   preexec_fn=address_space_limit(args.memory_limit) if args.memory_limit else None)
    say = (lambda line: print(line, file=sys.stderr)) if args.json else print
    device = device_key(probe)
    say(f"autotune bench {args.model} (family {family.name}) on {device}: {len(points)} point(s)")
    results = run_bench(job, points, progress=say)
    stored = None if args.no_store else _store(results, device, family, args.memory_limit)
    if args.json:
        print(json.dumps({"device": device, "family": family.name, "model": args.model, "steps": args.steps,
                          "warmup_steps": args.warmup, "points": [p.to_json() for p in results],
                          "stored_in": str(stored) if stored else None}, indent=2, sort_keys=True, default=str))
    else:
        render(results, cuda)
        if stored:
            print(f"stored for this machine's plans: {stored}")
    return 0 if any(p.outcome == Outcome.DONE for p in results) else 1


def _store(results: list[Any], device: str, family: FamilySpec, budget_mib: float | None) -> Path | None:
    from autotune.measure.store import from_done_event, from_oom_event, record_measurements

    records = []
    for point in results:
        if point.done_event:
            record = from_done_event({**point.done_event, "step_seconds": point.step_seconds}, device=device,
                                     family=family, source="bench")
        elif point.outcome == Outcome.OOM:
            record = from_oom_event(point.oom_event or {"settings": point.settings.to_event()}, device=device,
                                    family=family, source="bench", budget_mib=budget_mib)
        else:
            record = None
        if record is not None:
            records.append(record)
    return record_measurements(records) if records else None


def render(results: list[Any], cuda: bool) -> None:
    """The points as a table (the fastest that fits marked), then each point's phase breakdown where there is one."""
    from rich.console import Console
    from rich.table import Table

    from autotune.measure.learned import short_settings

    table = Table(show_lines=False)
    memory_column = "peak MiB alloc/reserved" if cuda else "peak MiB (RSS)"
    table.add_column("point", overflow="fold")
    table.add_column("batch x accum, settings", min_width=24)
    for column in ("it/s", "images/s", "s/step", memory_column, "outcome"):
        table.add_column(column, no_wrap=True)
    for p in results:
        memory = (f"{p.memory.get('cuda_max_allocated_mib', 0):.0f} / {p.memory.get('cuda_max_reserved_mib', 0):.0f}"
                  if cuda and p.memory else f"{p.peak_memory_mib or p.memory.get('peak_rss_mib') or 0:.0f}")
        outcome = "fastest" if p.fastest else p.outcome if p.outcome != Outcome.DONE else "ok"
        table.add_row(("* " if p.fastest else "") + p.label, short_settings(p.settings),
                      f"{p.it_per_s:.3g}" if p.it_per_s else "-", f"{p.images_per_s:.3g}" if p.images_per_s else "-",
                      f"{p.seconds_per_step:.4g}" if p.seconds_per_step else "-",
                      memory if p.outcome != Outcome.OOM else "-", outcome)
    console = Console(width=None if sys.stdout.isatty() else 200)  # piped: the whole table, not 80 columns
    console.print(table)
    console.print("* the fastest that fits (most images/s)")
    for p in results:
        line = phase_line(p.phases, p.seconds_per_step)
        if line:
            console.print(f"{p.label}: {line}")
        compiled = (p.done_event or {}).get("torch_compile")
        if isinstance(compiled, dict):
            console.print(f"{p.label}: {compile_line(compiled)}")
        if p.outcome not in (Outcome.DONE, Outcome.OOM):
            console.print(f"{p.label}: {p.outcome}: {p.message[:200]}")


def compile_line(compiled: dict[str, Any]) -> str:
    """done.json's ``torch_compile`` in one line: what compiled in how long, or why it ran eager."""
    if compiled.get("failure"):
        return f"torch_compile ({compiled.get('backend')}) failed, ran eager: {compiled['failure']}"
    return (f"{compiled.get('blocks')} blocks compiled ({compiled.get('backend')}, {compiled.get('graphs')} graphs) "
            f"in {float(compiled.get('seconds') or 0):.1f} s")


def phase_line(phases: dict[str, Any] | None, seconds_per_step: float | None = None) -> str:
    """The engine's per-phase breakdown in one line: with the point's measured s/step, each step phase's share of
    it in ms (so the line adds up to the table's s/step); else done.json's sampled ms per step as they are."""
    if not isinstance(phases, dict):
        return ""
    per_step = phases.get("sampled_ms_per_step")
    if isinstance(per_step, dict) and per_step:
        numbers = {k: float(v) for k, v in per_step.items() if isinstance(v, (int, float))}
        total = sum(numbers.values())
        if seconds_per_step and total > 0:
            return f"of {1000 * seconds_per_step:.0f} ms per step: " + ", ".join(
                f"{k} {1000 * seconds_per_step * v / total:.1f}" for k, v in numbers.items())
        return "ms per step: " + ", ".join(f"{k} {v:.1f}" for k, v in numbers.items())
    seconds = phases.get("seconds")
    if isinstance(seconds, dict):
        return "seconds: " + ", ".join(f"{k} {v:.2f}" for k, v in seconds.items() if isinstance(v, (int, float)))
    return ""
