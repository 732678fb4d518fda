"""Short real runs of the engine, one child process per settings point, measured and compared.

Each point is the base config (a plan's, or the user's ``--config``) with the point's settings written
in by the watchdog's own override (``settings_space.write_config``: the same keys a step-down writes), run for
``warmup + steps`` optimizer steps with nothing saved but the final LoRA. The engine's done.json gives
each step's time (the bench keeps the last ``steps``: the first steps of each new bucket shape build kernels
and run slow; the point's figure is their median) and the peak memory (CUDA max allocated and
reserved, or the peak RSS on a CPU), and its ``phases`` block where the engine writes one; an exit 87 is
an OOM. The fastest point that finished (most images/s) is marked.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from autotune.measure.learned import short_settings
from autotune.measure.store import steady_seconds_per_step
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.settings import TrainSettings

__all__ = ["BenchJob", "BenchPoint", "engine_argv", "measured_run_config", "parse_sweeps", "run_bench",
           "sweep_points"]
MAX_POINTS = 16
ENGINE_WARMUP_STEPS = 2  # the engine's TIMING_WARMUP_STEPS: done.json's step_seconds leave these out
# keys the bench removes from a config: a short run saves nothing on the way and logs nowhere
_NOT_IN_A_BENCH = ("max_train_epochs", "save_every_n_epochs", "save_every_n_steps", "save_last_n_epochs",
                   "save_last_n_steps", "save_state", "save_state_on_train_end", "sample_every_n_steps",
                   "sample_every_n_epochs", "sample_prompts", "log_with", "logging_dir", "resume",
                   "validate_every_n_steps", "validate_every_n_epochs", "validation_split")
SWEEP_KEYS = ("batch", "resolution", "rank", "checkpointing", "precision", "optimizer", "compile")


@dataclass(frozen=True)
class BenchPoint:
    """One measured point. ``outcome``: done | oom | the watchdog's other outcomes (crash, stall, ...)."""

    label: str
    settings: TrainSettings
    outcome: str
    message: str = ""
    seconds_per_step: float | None = None
    step_seconds: tuple[float, ...] = ()  # the timed steps (after the bench's warm-up)
    peak_memory_mib: float | None = None
    memory: dict[str, float] = field(default_factory=dict)
    phases: dict[str, Any] | None = None
    done_event: dict[str, Any] | None = None
    oom_event: dict[str, Any] | None = None
    fastest: bool = False

    @property
    def it_per_s(self) -> float | None:
        return 1.0 / self.seconds_per_step if self.seconds_per_step else None

    @property
    def images_per_s(self) -> float | None:
        s = self.settings
        return s.train_batch_size * s.gradient_accumulation_steps / self.seconds_per_step \
            if self.seconds_per_step else None

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "settings": self.settings.to_event(), "outcome": self.outcome,
                "message": self.message, "seconds_per_step": self.seconds_per_step, "it_per_s": self.it_per_s,
                "images_per_s": self.images_per_s, "timed_steps": len(self.step_seconds),
                "step_seconds": list(self.step_seconds),
                "peak_memory_mib": self.peak_memory_mib, "memory": self.memory, "phases": self.phases,
                "torch_compile": (self.done_event or {}).get("torch_compile"), "fastest": self.fastest}


def _on_off(text: str, option: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "on", "true", "yes"):
        return True
    if value in ("0", "off", "false", "no"):
        return False
    raise UserError(f"{option}: {text!r} is not on/off (use 0,1 or off,on)")


def _positive(text: str, option: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise UserError(f"{option}: {text!r} is not a positive whole number")
    return int(text)


def apply_sweep_value(base: TrainSettings, key: str, text: str, option: str) -> TrainSettings:
    """``base`` with one sweep value set; batch keeps the effective batch (accumulation follows, as the
    planner's search does), resolution moves the bucket limit with it (twice the side, the planner's rule), rank
    keeps the LoRA's scale (alpha in proportion)."""
    from sd_scripts_compat.facts.settings_space import at_square_resolution

    if key == "batch":
        batch = _positive(text, option)
        return replace(base, train_batch_size=batch,
                       gradient_accumulation_steps=max(1, math.ceil(base.effective_batch / batch)))
    if key == "resolution":
        return at_square_resolution(base, _positive(text, option))
    if key == "rank":
        return base.with_rank(_positive(text, option))
    if key == "checkpointing":
        return replace(base, gradient_checkpointing=_on_off(text, option))
    if key == "precision":
        value = {"fp32": "no", "no": "no", "fp16": "fp16", "bf16": "bf16"}.get(text.strip().lower())
        if value is None:
            raise UserError(f"{option}: precision {text!r}; choose from no (fp32), fp16, bf16")
        return replace(base, mixed_precision=value)
    if key == "optimizer":
        return replace(base, optimizer_type=text.strip())
    if key == "compile":  # off, on (inductor) or a dynamo backend's name
        return _compiled(base, text.strip(), option)
    raise UserError(f"{option}: unknown setting {key!r}; sweep one of {', '.join(SWEEP_KEYS)}")


def _compiled(base: TrainSettings, value: str, option: str) -> TrainSettings:
    """A compile sweep value: off, on (inductor), or one of sd-scripts' dynamo_backend choices."""
    from sd_scripts_compat.facts.kohya_args import arg_specs

    if value.lower() in ("0", "off", "false", "no"):
        return replace(base, torch_compile=False)
    backend = "inductor" if value.lower() in ("1", "on", "true", "yes") else value
    choices = arg_specs()["dynamo_backend"].choices or ()
    if backend not in choices:
        raise UserError(f"{option}: {value!r} is neither off/on nor a dynamo_backend ({', '.join(choices)})")
    return replace(base, torch_compile=True, dynamo_backend=backend)


def parse_sweeps(specs: Sequence[str]) -> list[tuple[str, list[str]]]:
    """``["batch=1,2,4", "precision=no,bf16"]`` -> ``[("batch", ["1", "2", "4"]), ...]``; bad ones are one line."""
    out: list[tuple[str, list[str]]] = []
    for spec in specs:
        key, sep, values = spec.partition("=")
        key = key.strip().lower()
        items = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not items:
            raise UserError(f"--sweep {spec}: write KEY=V1,V2,... e.g. --sweep batch=1,2,4,8")
        if key not in SWEEP_KEYS:
            raise UserError(f"--sweep {spec}: unknown setting {key!r}; sweep one of {', '.join(SWEEP_KEYS)}")
        if any(key == seen for seen, _ in out):
            raise UserError(f"--sweep {spec}: {key} is swept twice; give its values once, e.g. --sweep {key}=1,2,4")
        out.append((key, items))
    return out


def sweep_points(base: TrainSettings, sweeps: Sequence[tuple[str, list[str]]]) -> list[tuple[str, TrainSettings]]:
    """Every combination of the sweep values (the base alone without a sweep), labelled ``batch=2 precision=bf16``."""
    if not sweeps:
        return [("plan", base)]
    combos = list(itertools.product(*[[(key, v) for v in values] for key, values in sweeps]))
    if len(combos) > MAX_POINTS:
        raise UserError(f"--sweep: {len(combos)} points; at most {MAX_POINTS} in one bench (sweep fewer values)")
    points = []
    for combo in combos:
        settings = base
        for key, value in combo:
            settings = apply_sweep_value(settings, key, value, f"--sweep {key}={value}")
        points.append((" ".join(f"{k}={v}" for k, v in combo), settings))
    return points


def bench_config(src: Path, dst: Path, settings: TrainSettings, base: TrainSettings, *, steps: int,
                 output_dir: Path) -> None:
    """The point's config: ``src`` with its settings, ``steps`` optimizer steps, nothing saved on the way."""
    from sd_scripts_compat.facts.kohya_toml import read_toml, set_config_values, write_toml
    from sd_scripts_compat.facts.settings_space import write_config

    write_config(src, dst, settings, base=base)
    document = _without(read_toml(dst), _NOT_IN_A_BENCH)
    forced = {"max_train_steps": steps, "output_dir": str(output_dir), "output_name": "bench"}
    write_toml(dst, set_config_values(document, forced), f"# autotune bench point, from {src}\n")


def _without(document: dict[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    out = {k: v for k, v in document.items() if k not in keys}
    return {k: _without(v, keys) if isinstance(v, dict) else v for k, v in out.items()}


@dataclass(frozen=True)
class BenchJob:
    """What every point shares: the base files and settings, the engine module, the environment."""

    config: Path
    dataset_config: Path | None
    base: TrainSettings
    engine_module: str
    workdir: Path
    steps: int
    warmup: int
    env: dict[str, str]
    cuda: bool
    stall_timeout_s: float = 600.0
    preexec_fn: Callable[[], None] | None = None


def measured_run_config(path: Path, *, model: str, dataset: Path, output_dir: Path, resolution: int, steps: int,
                        **kohya: object) -> Path:
    """A short measured run's config.toml (what the bench scripts train; kohya keys in ``kohya`` win): batch 1,
    rank 4, the UNet only, AdamW at 1e-4, fixed seed, no loader workers, cached latents, nothing saved on the
    way. Returns ``path``."""
    from sd_scripts_compat.facts.kohya_toml import write_toml

    values: dict[str, Any] = {
        "pretrained_model_name_or_path": model, "train_data_dir": str(dataset), "output_dir": str(output_dir),
        "output_name": "bench", "resolution": f"{resolution},{resolution}", "caption_extension": ".txt",
        "train_batch_size": 1, "max_train_steps": steps, "network_dim": 4, "network_alpha": 4,
        "network_train_unet_only": True, "learning_rate": 1e-4, "optimizer_type": "AdamW", "seed": 1,
        "max_data_loader_n_workers": 0, "cache_latents": True, **kohya}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_toml(path, values, "# a measured engine run (autotune.launch.bench.measured_run_config)\n")
    return path


def engine_argv(module: str, config: Path, events_dir: Path, *, dataset_config: Path | None = None,
                extra: Sequence[str] = ()) -> list[str]:
    """The command line of one measured engine run (``python -m <module>``), its events in ``events_dir``."""
    from sd_scripts_compat.facts.contract import EVENTS_DIR_FLAG

    argv = [sys.executable, "-m", module, "--config_file", str(config)]
    if dataset_config is not None:
        argv += ["--dataset_config", str(dataset_config)]
    return [*argv, EVENTS_DIR_FLAG, str(events_dir), *extra]


def run_point(job: BenchJob, index: int, label: str, settings: TrainSettings) -> BenchPoint:
    """One engine child process for one point; its done.json / oom.json read back."""
    from autotune.recovery.attempt import child_env, run_attempt
    from sd_scripts_compat.facts.contract import Outcome
    from sd_scripts_compat.facts.settings_space import write_dataset_config

    folder = job.workdir / f"point{index:02d}"
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "config.toml"
    bench_config(job.config, config, settings, job.base, steps=job.steps + job.warmup, output_dir=folder / "out")
    dataset = None
    if job.dataset_config is not None:
        dataset = folder / "dataset.toml"
        write_dataset_config(job.dataset_config, dataset, settings, base=job.base)
    argv = engine_argv(job.engine_module, config, folder / "events", dataset_config=dataset)
    result = run_attempt(argv, env=child_env(job.env, job.cuda), events_dir=folder / "events",
                         log_path=folder / "train.log", stall_timeout_s=job.stall_timeout_s, echo=False,
                         preexec_fn=job.preexec_fn)
    if result.outcome is Outcome.USER_ERROR:
        raise UserError(result.message.split(": error: ", 1)[-1])
    done = result.done_event or {}
    memory = dict(done.get("memory") or (result.oom_event or {}).get("memory") or {})
    if not memory.get("peak_rss_mib") and result.peak_rss_mib:
        memory["peak_rss_mib"] = result.peak_rss_mib
    # done.json leaves out the engine's first 2 steps; the rest of the bench's warm-up goes here
    timed = tuple(float(v) for v in (done.get("step_seconds") or [])[max(0, job.warmup - ENGINE_WARMUP_STEPS):])
    return BenchPoint(label=label, settings=settings, outcome=result.outcome, message=result.message,
                      seconds_per_step=steady_seconds_per_step({"step_seconds": timed}) if timed else None,
                      step_seconds=timed,
                      peak_memory_mib=done.get("peak_memory"), memory=memory, phases=done.get("phases"),
                      done_event=result.done_event, oom_event=result.oom_event)


def run_bench(job: BenchJob, points: Sequence[tuple[str, TrainSettings]],
              progress: Callable[[str], None] | None = None) -> list[BenchPoint]:
    """Every point in turn; the one with the most images/s among those that finished is marked fastest."""
    results = []
    for index, (label, settings) in enumerate(points):
        if progress is not None:
            progress(f"[{index + 1}/{len(points)}] {label}: {short_settings(settings)}; {job.warmup} warm-up + "
                     f"{job.steps} timed steps")
        results.append(run_point(job, index, label, settings))
        if progress is not None:  # each point as it finishes: a sweep takes minutes
            progress(f"[{index + 1}/{len(points)}] {label}: {point_line(results[-1])}")
    timed = [p for p in results if p.images_per_s]
    if timed:
        best = max(timed, key=lambda p: p.images_per_s or 0.0)
        results = [replace(p, fastest=p is best) for p in results]
    return results


def point_line(point: BenchPoint) -> str:
    """One finished point: its speed and peak memory, or how it ended."""
    if not point.seconds_per_step:
        return f"{point.outcome}: {point.message[:160]}"
    memory = point.peak_memory_mib or point.memory.get("peak_rss_mib")
    return (f"{point.it_per_s:.3g} it/s, {point.images_per_s:.3g} images/s, {point.seconds_per_step:.4g} s/step"
            + (f", peak {memory:.0f} MiB" if memory else ""))


def engine_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: offline (the engine never downloads)."""
    return {**(base if base is not None else os.environ), "HF_HUB_OFFLINE": "1"}
