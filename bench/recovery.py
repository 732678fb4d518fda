"""How fast `autotune run` recovers: seconds from a failure to the first resumed step, and steps lost.

Runs the real engine (builtin:tiny-sd15, 128 px: 16x16 latents, CPU fp32) under the watchdog in three scenarios:
  injected OOM   SD_COMPAT_INJECT_OOM=step=N: the engine catches a real torch.OutOfMemoryError,
                 saves state, exits 87; the watchdog steps down and resumes.
  pixel OOM      SD_COMPAT_INJECT_OOM=pixels_gt=P: every micro-batch above P pixels fails, so the
                 first step of the first attempt fails (recovery before any progress).
  SIGKILL        the child is killed as the OS OOM killer would (no chance to save); the watchdog
                 resumes from the last time-based state (--save_state_every_seconds).
A monitor thread samples progress.json; the first resumed step's end is back-computed from the
first progress report after the restart (time - (step - resume_step - 1) / it_per_s).

    HF_HUB_OFFLINE=1 .venv/bin/python bench/recovery.py [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.layout import EVENTS_DIR  # noqa: E402
from autotune.recovery.engine import CompatEngine  # noqa: E402
from autotune.recovery.ladder import LadderLimits, memory_predictor  # noqa: E402
from autotune.recovery.watchdog import Job, supervise  # noqa: E402
from sd_scripts_compat.config.resolved_run import settings_from_files  # noqa: E402
from sd_scripts_compat.facts.families import get_family  # noqa: E402


def make_dataset(root: Path) -> Path:
    import numpy as np
    from PIL import Image

    folder = root / "data" / "1_toy"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(4):
        Image.fromarray((rng.random((128, 128, 3)) * 255).astype("uint8")).save(folder / f"img{i}.png")
        (folder / f"img{i}.caption").write_text(f"a toy picture {i}")
    return folder.parent


class Monitor:
    """Samples the events folder and remembers every child start, progress report and OOM event."""

    def __init__(self, events: Path) -> None:
        self.events = events
        self.starts: list[float] = []
        self.progress: list[dict] = []
        self.oom_times: list[float] = []
        self.kill_at_step: int | None = None
        self.killed: list[tuple[float, int]] = []
        self._pid: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def on_start(self, pid: int) -> None:
        self.starts.append(time.time())
        self._pid = pid

    def _loop(self) -> None:
        seen_progress, seen_oom = None, None
        while not self._stop.is_set():
            try:
                stat = (self.events / "progress.json").stat().st_mtime_ns
                if stat != seen_progress:
                    seen_progress = stat
                    record = json.loads((self.events / "progress.json").read_text())
                    self.progress.append(record)
                    if self.kill_at_step is not None and not self.killed and record["step"] >= self.kill_at_step:
                        os.kill(self._pid, signal.SIGKILL)
                        self.killed.append((time.time(), record["step"]))
            except (OSError, ValueError):
                pass
            try:
                stat = (self.events / "oom.json").stat().st_mtime
                if stat != seen_oom:
                    seen_oom = stat
                    self.oom_times.append(stat)
            except OSError:
                pass
            time.sleep(0.02)

    def __enter__(self) -> Monitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def scenario(tmp: Path, data: Path, name: str, *, micro: int, accum: int, steps: int, inject: str | None,
             kill_at: int | None = None, save_every: float = 30.0) -> dict:
    out = tmp / name
    out.mkdir()
    config = {
        "pretrained_model_name_or_path": "builtin:tiny-sd15", "train_data_dir": str(data),
        "output_dir": str(out / "output"), "output_name": "lora", "resolution": "128,128",
        "train_batch_size": micro, "gradient_accumulation_steps": accum, "max_train_steps": steps,
        "network_module": "networks.lora", "network_dim": 4, "network_alpha": 2, "learning_rate": 1e-3,
        "optimizer_type": "AdamW", "mixed_precision": "no", "seed": 7, "caption_extension": ".caption",
        "max_data_loader_n_workers": 0,
    }
    import toml

    (out / "config.toml").write_text(toml.dumps(config))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("SD_COMPAT_INJECT_OOM", None)
    if inject:
        env["SD_COMPAT_INJECT_OOM"] = inject
    with Monitor(out / EVENTS_DIR) as monitor:
        monitor.kill_at_step = kill_at
        job = Job(config_path=out / "config.toml", output_dir=out,
                  settings=settings_from_files(out / "config.toml", None, sdxl=False).settings,
                  limits=LadderLimits(budget_mib=1e6, min_resolution=64, resolution_step=64),
                  predict=memory_predictor(get_family("tiny-sd15"), cuda=False), env=env, echo=False,
                  train_output_dir=out / "output", engine=CompatEngine(save_state_every_s=save_every),
                  on_child_start=monitor.on_start)
        started = time.time()
        result = supervise(job)
        total = time.time() - started
    if not result.ok or not result.retries:
        return {"name": name, "error": result.message}
    record = result.retries[0]
    failure_time = monitor.killed[0][0] if monitor.killed else (
        monitor.oom_times[0] if monitor.oom_times else monitor.starts[0] + result.attempts[0].seconds)
    resume = record["resume_step"]
    after = [p for p in monitor.progress if p["time"] > failure_time and p["step"] > resume]
    first = after[0] if after else None
    first_step_end = first["time"] - (first["step"] - resume - 1) / first["it_per_s"] if first else float("nan")
    restart = monitor.starts[1] - failure_time if len(monitor.starts) > 1 else float("nan")
    failed_step = monitor.killed[0][1] if monitor.killed else record["step"]
    return {"name": name, "failed_step": failed_step, "resume_step": resume,
            "steps_lost": max(0, failed_step - resume), "to_first_step_s": first_step_end - failure_time,
            "watchdog_s": restart, "total_s": total, "retries": len(result.retries),
            "it_per_s": first["it_per_s"] if first else float("nan")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="recovery-bench-") as tmp_name:
        tmp = Path(tmp_name)
        data = make_dataset(tmp)
        for r in range(args.repeats):
            rows.append(scenario(tmp, data, f"injected OOM {r}", micro=2, accum=2, steps=6, inject="step=3"))
            rows.append(scenario(tmp, data, f"pixel OOM {r}", micro=4, accum=1, steps=3,
                                 # micro-batch x latent px x the VAE's 8: 4 x 128 x 128 fails, 2 x 128 x 128 runs
                                 inject=f"pixels_gt={2 * 128 * 128}"))
            rows.append(scenario(tmp, data, f"SIGKILL {r}", micro=1, accum=1, steps=40, inject=None,
                                 kill_at=6, save_every=1.0))
    print("\n| scenario | failed at step | resumed at step | steps lost | failure -> first resumed step (s) "
          "| of which failure -> child restarted (s) | it/s after |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['name']} | error: {row['error']} |||||")
            continue
        print(f"| {row['name']} | {row['failed_step']} | {row['resume_step']} | {row['steps_lost']} | "
              f"{row['to_first_step_s']:.1f} | {row['watchdog_s']:.2f} | {row['it_per_s']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
