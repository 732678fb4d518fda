"""The report of one run and its ONE dominant bottleneck, with the concrete fix.

The bottleneck is the first of these that holds (the order is how much each costs a typical run):
1. a detector finding (VRAM spill, swapping, throttled clocks: ``report.detector``);
2. data-bound: the step waited :data:`DATA_BOUND_FRACTION` or more of its time for the loader;
3. VAE-bound: encoding images every step took :data:`VAE_BOUND_FRACTION` or more (latents not cached);
4. events-bound: validation, saves and samples took :data:`EVENTS_BOUND_FRACTION` or more of the loop;
5. memory headroom (CUDA): the peak used under :data:`HEADROOM_FRACTION` of the card and the memory model
   finds a larger micro-batch that fits and is predicted clearly faster;
6. the device idled: busy under :data:`BUSY_FRACTION` of the time (a GPU's utilisation; on a CPU the trainer's
   CPU time over its threads): contention when other processes kept the machine's CPUs busy meanwhile, else the
   trainer's own idling;
7. otherwise compute-bound: the device itself is the limit, and was busy.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import replace
from typing import Any

from autotune.report.detector import detect, training_samples
from autotune.report.load import RunFiles
from sd_scripts_compat.training.phase_timer import PHASES, STEP_PHASES

REPORT_SCHEMA = 1
DATA_BOUND_FRACTION = 0.20
VAE_BOUND_FRACTION = 0.25
EVENTS_BOUND_FRACTION = 0.25
HEADROOM_FRACTION = 0.60
BUSY_FRACTION = 0.70  # below this share of the wall time busy, a run is not called compute-bound
OTHERS_CORES = 0.5  # other processes using this many cores or more (averaged) is contention
HEADROOM_MIN_SPEEDUP = 1.15
MIB, GIB = 2**20, 2**30


def build_report(run: RunFiles) -> dict[str, Any]:
    """The report as one JSON-ready dict (``schema`` :data:`REPORT_SCHEMA`); see the module docstring."""
    done, phases = run.done or {}, run.phases
    findings = detect(run.samples, run.max_steps)
    devices = device_rows(run)
    report: dict[str, Any] = {
        "schema": REPORT_SCHEMA, "output_dir": str(run.folder), "outcome": "done" if run.done else "incomplete",
        "steps": done.get("steps") or (run.progress or {}).get("step"), "attempts": run.attempts,
        "family": done.get("family") or (run.plan or {}).get("family"),
        "phases": phase_table(phases), "speed": speed(run), "devices": devices,
        "memory": memory(run, devices), "communication": communication(run),
        "findings": [f.to_dict() for f in findings], "resumed_changed": list(run.resumed_changed),
    }
    report["bottleneck"] = bottleneck(run, report, findings)
    return report


def phase_table(phases: dict[str, Any] | None) -> dict[str, Any] | None:
    """Seconds per phase, their share of the wall time and (step phases) of the step time."""
    if phases is None:
        return None
    given = phases["seconds"]  # in the timer's order (done.json sorts its keys), unknown names last
    seconds = {k: float(given[k]) for k in [*[p for p in PHASES if p in given], *sorted(set(given) - set(PHASES))]}
    wall = float(phases.get("wall_seconds") or sum(seconds.values()))
    step = float(phases.get("step_seconds") or sum(seconds.get(k, 0.0) for k in STEP_PHASES))
    return {"wall_seconds": wall, "step_seconds": step, "seconds": seconds,
            "of_wall": {k: v / wall if wall else 0.0 for k, v in seconds.items()},
            "of_steps": {k: seconds.get(k, 0.0) / step if step else 0.0 for k in STEP_PHASES},
            "covered_fraction": 1 - seconds.get("other", 0.0) / wall if wall else 0.0,
            "sampled_steps": phases.get("sampled_steps"), "steps": phases.get("steps"),
            "method": phases.get("method"), "loader_workers": phases.get("loader_workers")}


def speed(run: RunFiles) -> dict[str, Any]:
    """Measured it/s (steady state, done.json) against the plan's prediction."""
    seconds_per_step = (run.done or {}).get("seconds_per_step")
    measured = 1 / seconds_per_step if seconds_per_step else (run.progress or {}).get("it_per_s")
    predicted = ((run.plan or {}).get("prediction") or {}).get("it_per_s")
    ratio = measured / predicted if measured and predicted else None
    return {"measured_it_per_s": measured, "predicted_it_per_s": predicted, "measured_over_predicted": ratio}


def device_rows(run: RunFiles) -> list[dict[str, Any]]:
    """Per GPU (NVML) busy %, peak and total memory, mean SM clock; without GPUs one row for the CPU process."""
    during = training_samples(run.samples, run.max_steps) or run.samples
    names = {g.get("index"): g.get("name") for g in run.header.get("gpus") or []}
    by_index: dict[int, list[dict[str, Any]]] = {}
    for sample in during:
        for gpu in sample.get("gpus") or []:
            by_index.setdefault(gpu["index"], []).append(gpu)
    rows = [{"device": f"cuda:{i}", "name": names.get(i), "busy_percent": _mean(g.get("util_percent") for g in gs),
             "peak_used_bytes": max((g.get("mem_used_bytes") or 0 for g in gs), default=None),
             "total_bytes": next((g.get("mem_total_bytes") for g in gs if g.get("mem_total_bytes")), None),
             "sm_clock_mhz": _mean(g.get("sm_clock_mhz") for g in gs),
             "max_sm_clock_mhz": next((g.get("max_sm_clock_mhz") for g in gs if g.get("max_sm_clock_mhz")), None),
             "power_w": _mean(g.get("power_w") for g in gs)} for i, gs in sorted(by_index.items())]
    if rows or not during:
        return rows
    cores = run.header.get("cpu_count") or os.cpu_count() or 1
    threads = min(run.header.get("threads") or cores, cores)
    cpu = _mean((s.get("proc") or {}).get("cpu_percent") for s in during)
    machine = _mean((s.get("sys") or {}).get("cpu_percent") for s in during)
    others = max(0.0, machine * cores / 100 - cpu / 100) if cpu is not None and machine is not None else None
    return [{"device": "cpu", "name": f"CPU ({cores} logical cores, {threads} training threads)",
             "busy_percent": min(100.0, cpu / threads) if cpu is not None else None,
             "peak_used_bytes": max(((s.get("proc") or {}).get("rss_bytes") or 0 for s in during), default=None),
             "total_bytes": run.header.get("ram_total_bytes"), "process_cpu_percent": cpu,
             "machine_cpu_percent": machine, "other_processes_cores": others, "threads": threads,
             "load_1m": _mean((s.get("sys") or {}).get("load_1m") for s in during)}]


def memory(run: RunFiles, devices: list[dict[str, Any]]) -> dict[str, Any]:
    """The engine's peak (CUDA reserved, the emulated card's count, or RSS on CPU) against the card (or RAM)."""
    peak_mib = (run.done or {}).get("peak_memory")
    card = ((run.done or {}).get("memory") or {}).get("emulated_card_mib")
    if isinstance(card, (int, float)) and peak_mib:  # --emulate-card: the engine's peak is the card's count
        return {"peak_bytes": peak_mib * MIB, "kind": "emulated_card", "total_bytes": card * MIB, "device": "cpu"}
    cuda = bool(devices) and devices[0]["device"].startswith("cuda")
    total = devices[0]["total_bytes"] if devices else run.header.get("ram_total_bytes")
    peaks = (run.done or {}).get("process_peaks")
    each = [float(p) * MIB for p in peaks if isinstance(p, (int, float))] if isinstance(peaks, list) else []
    return {"peak_bytes": peak_mib * MIB if peak_mib else (devices[0]["peak_used_bytes"] if devices else None),
            "kind": "cuda_max_reserved" if cuda else "peak_rss", "total_bytes": total,
            "device": devices[0]["device"] if devices else None,
            "process_peak_bytes": each if len(each) > 1 else None}  # several processes: each one's


def communication(run: RunFiles) -> dict[str, Any] | None:
    """Several processes: each one's collectives in its profiled step (``training.comm_profile``) against the run's
    measured seconds per step, as ``{"step_seconds", "method", "per_process": [{"seconds", "share"} | None]}``."""
    done = run.done or {}
    each, step_seconds = done.get("communication"), done.get("seconds_per_step")
    if not isinstance(each, list) or not any(isinstance(c, dict) for c in each):
        return None
    step = float(step_seconds) if isinstance(step_seconds, (int, float)) and step_seconds > 0 else None
    rows: list[dict[str, Any] | None] = []
    for profiled in each:
        seconds = profiled.get("seconds") if isinstance(profiled, dict) else None
        rows.append({"seconds": float(seconds), "share": min(1.0, seconds / step) if step else None}
                    if isinstance(seconds, (int, float)) and seconds >= 0 else None)
    method = next(c.get("method") for c in each if isinstance(c, dict))
    return {"step_seconds": step, "method": method, "per_process": rows}


def bottleneck(run: RunFiles, report: dict[str, Any], findings: list[Any]) -> dict[str, Any]:
    """The one dominant bottleneck: ``kind``, ``message``, ``fix`` (see the module docstring for the order)."""
    if findings:
        first = findings[0]
        return {"kind": first.kind, "message": first.message, "fix": first.fix}
    table = report["phases"]
    if table is None:
        return {"kind": "unknown", "message": "the engine reported no phase breakdown (a run that did not finish, "
                "or another engine)", "fix": "run to the end with autotune's engine to see where the time goes"}
    of_steps, settings = table["of_steps"], (run.done or {}).get("settings") or {}
    idle = "GPU" if report["devices"] and report["devices"][0]["device"].startswith("cuda") else "the trainer"
    if of_steps["data"] >= DATA_BOUND_FRACTION:
        return _data_bound(of_steps["data"], idle, table.get("loader_workers") or 0, settings)
    if of_steps["vae_encode"] >= VAE_BOUND_FRACTION:
        return {"kind": "vae_bound", "message": f"encoding images with the VAE every step took "
                f"{100 * of_steps['vae_encode']:.0f}% of the step time", "fix": "set cache_latents = true "
                "(each image is encoded once, before training)"}
    loop = table["step_seconds"] + sum(table["seconds"].get(k, 0.0) for k in ("validation", "save", "sample"))
    events = loop - table["step_seconds"]
    if loop and events / loop >= EVENTS_BOUND_FRACTION:
        return {"kind": "events_bound", "message": f"validation, saves and samples took {100 * events / loop:.0f}% "
                "of the training loop", "fix": "save, sample and validate less often (save_every_n_steps, "
                "sample_every_n_steps, validate_every_n_steps)"}
    room = headroom(run, report)
    if room is not None:
        return room
    idling = idle_device(report["devices"])
    if idling is not None:
        return idling
    compute = sum(of_steps[k] for k in ("forward", "backward", "optimizer"))
    return {"kind": "compute_bound", "message": f"compute-bound: forward, backward and optimizer are "
            f"{100 * compute:.0f}% of the step time (waiting for data {100 * of_steps['data']:.0f}%)",
            "fix": "nothing idles: only a faster device, a lower resolution or fewer steps make it quicker"}


def idle_device(devices: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The device was busy under BUSY_FRACTION of the time: who took the machine (contention), or that the trainer
    itself idled; None when it was busy (or nothing says how busy)."""
    if not devices or devices[0].get("busy_percent") is None or devices[0]["busy_percent"] >= 100 * BUSY_FRACTION:
        return None
    row, busy = devices[0], devices[0]["busy_percent"]
    if row["device"].startswith("cuda"):
        return {"kind": "device_idle", "message": f"the GPU was busy {busy:.0f}% of the time: its kernels wait "
                "for the host (small steps, Python overhead, copies)", "fix": "a larger micro-batch or fewer, larger "
                "kernels (sdpa, no per-step syncs); see the phases above for the host's share"}
    others, cores, load = row.get("other_processes_cores"), row["name"], row.get("load_1m")
    threads = f"{row['threads']} thread{'s' if row['threads'] != 1 else ''}"
    if others is not None and others >= OTHERS_CORES:
        return {"kind": "cpu_contention", "message": f"the trainer's {threads} ran {busy:.0f}% of the "
                f"time: other processes kept {others:.1f} cores of the {cores.split(' (')[1].split(' logical')[0]} "
                f"busy meanwhile" + (f" (load average {load:.1f})" if load is not None else ""),
                "fix": "stop the other work while training, or give the trainer fewer threads (OMP_NUM_THREADS) so "
                "the two do not preempt each other"}
    return {"kind": "device_idle", "message": f"the trainer's {threads} ran {busy:.0f}% of the time "
            "with the machine otherwise idle: it waits between kernels (small steps, Python overhead)",
            "fix": "a larger micro-batch gives each step more work per thread"}


def contention(run: RunFiles) -> str | None:
    """Why the run's speed says little about this machine (other processes took its CPU), or None."""
    found = idle_device(device_rows(run))
    return found["message"] if found and found["kind"] == "cpu_contention" else None


def _data_bound(fraction: float, idle: str, workers: int, settings: dict[str, Any]) -> dict[str, Any]:
    suggest = min(8, max(2, (os.cpu_count() or 2) - 1)) if workers == 0 else min(16, workers * 2)
    fix = f"set max_data_loader_n_workers = {suggest}"
    if not settings.get("cache_latents"):
        fix += " or cache_latents = true (images are decoded and encoded once, before training)"
    share = f"{100 * fraction:.0f}%"
    what = f"GPU idle {share} waiting for data" if idle == "GPU" else f"the trainer waited {share} of its step " \
        "time for data"
    return {"kind": "data_bound", "message": f"{what} ({workers} loader worker{'s' if workers != 1 else ''})",
            "fix": fix}


def headroom(run: RunFiles, report: dict[str, Any]) -> dict[str, Any] | None:
    """On CUDA, a larger micro-batch that the memory model says fits (scaled by this run's measured peak over
    its own prediction) and the speed model says is clearly faster; None when there is none."""
    mem, done = report["memory"], run.done or {}
    if mem["kind"] != "cuda_max_reserved" or not mem["peak_bytes"] or not mem["total_bytes"] or not done:
        return None
    if mem["peak_bytes"] >= HEADROOM_FRACTION * mem["total_bytes"]:
        return None
    found = larger_batch(done, mem["peak_bytes"], mem["total_bytes"])
    if found is None:
        return None
    batch, predicted, speedup = found
    return {"kind": "memory_headroom", "message": f"peak {mem['peak_bytes'] / GIB:.1f} of "
            f"{mem['total_bytes'] / GIB:.0f} GiB", "fix": f"batch {batch} fits (predicted {predicted / GIB:.1f} GiB) "
            f"and would run ~{speedup:.1f}x faster (train_batch_size = {batch})", "batch": batch}


def larger_batch(done: dict[str, Any], peak_bytes: float, total_bytes: float) -> tuple[int, float, float] | None:
    """(micro-batch, predicted bytes, predicted samples/s speed-up) of the largest batch (up to 16x, 64) that fits."""
    from autotune.estimate.memory_model import inputs_for_settings, predict_memory
    from autotune.estimate.speed_model import predict_speed
    from sd_scripts_compat.facts.families import get_family
    from sd_scripts_compat.facts.settings import TrainSettings

    try:
        settings = TrainSettings.from_event(done["settings"])
        cached = bool((done.get("resolved") or {}).get("text_encoder_outputs_cached"))
        base = inputs_for_settings(get_family(done["family"]), settings, text_encoder_outputs_cached=cached)
        scale = peak_bytes / predict_memory(base).peak_bytes  # this run's measured / predicted
        now = predict_speed(base, peak_tflops=100.0)  # any rate: only the ratio is used
        best = None
        for batch in range(base.batch_size + 1, min(16 * base.batch_size, 64) + 1):
            bigger = replace(base, batch_size=batch)
            predicted = predict_memory(bigger).total_bytes * scale
            if predicted > total_bytes:
                break
            speedup = (batch / predict_speed(bigger, peak_tflops=100.0).seconds_per_step) / \
                (base.batch_size / now.seconds_per_step)
            best = (batch, predicted, speedup)
    except (KeyError, ValueError, TypeError, ZeroDivisionError):  # another family or an older done.json
        return None
    return best if best is not None and best[2] >= HEADROOM_MIN_SPEEDUP else None


def _mean(values: Any) -> float | None:
    numbers = [float(v) for v in values if v is not None]
    return statistics.fmean(numbers) if numbers else None
