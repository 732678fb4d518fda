"""Our engine against the user's sd-scripts, side by side on this machine: the same model file, config and dataset.

Needs a local sd-scripts checkout and the Python that runs it (never committed; the benchmark says so and stops
when they are absent):

    LORA_AUTOTUNE_SD_SCRIPTS=~/sd-scripts LORA_AUTOTUNE_SD_SCRIPTS_PYTHON=~/sd-scripts/venv/bin/python \\
        python bench/vs_sd_scripts.py --pairs 5 --steps 10 --precision no,bf16

It writes one random-weight SD1.5 single file (fp16, kohya's original layout; ``--family sdxl`` for SDXL at a
small ``--resolution``), one config.toml both engines read unchanged (batch 1, rank 8, UNet only, AdamW, cached
latents, SDPA) and runs the sides in rounds, ``--pairs`` rounds per precision, each side leading in turn and each
run waiting for a quiet machine first (1-minute load average under ``--quiet-load``). The sides: ``ours``,
``sd-scripts`` and ``bare``, the bare loop of ``bench/bare_step.py`` (the same model file and 192 adapters, forward
+ backward + optimizer step and nothing else: the floor). All run under the same launcher, which registers torch's
global optimizer-step hook: a step's time is the gap between two optimizer steps' ends, steps 3..N timed. Whole-run
wall time, peak RSS (Linux's ``VmHWM``) and page faults per step come from the same launcher. The table gives each
side's median s/step, the median of the per-round ratios (ours / sd-scripts, ours / bare), and the wall-time and
RSS ratios; it then checks that both LoRA files hold the same modules (key names and shapes).

``--profile N`` adds one run per side that profiles N steps after the warm-up with torch's profiler (CPU
activities) and prints the operators side by side: self CPU ms and calls per step, the largest first.
``--sides ours,bare`` needs no sd-scripts.

``--planned`` adds a fourth side, ``planned``: our engine at the settings ``autotune plan`` chooses for this machine
(``--no-learn``; only the recipe's resolution and rank pinned, and as many optimizer steps), on a copy of the dataset
so its latent caches stay out of the repository. It runs in the rows of the plan's own precision, and the table
compares time per image, the plan's micro-batch being larger than the recipe's one image: seconds per image at the
steady step, and the whole run's wall time per image trained, each against sd-scripts at the recipe. With the
``bare`` side it adds ``planned-bare`` too: the bare loop at the plan's micro-batch and precision (UNet only), the
floor per image that any engine training these adapters at that batch meets on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATASET = ROOT / "examples" / "dataset"
SCRIPTS_ENV, PYTHON_ENV = "LORA_AUTOTUNE_SD_SCRIPTS", "LORA_AUTOTUNE_SD_SCRIPTS_PYTHON"
TIMED_FROM = 2  # steps 1 and 2 warm up; step 3 onwards is timed
# The launcher every side runs under: torch's global optimizer-step hook stamps each step's end and its page-fault
# count, and with $VS_PROFILE ("FIRST,COUNT") profiles COUNT steps after step FIRST; the stamps, faults, profile,
# wall time and peak RSS go to $VS_TIMES when the process exits.
LAUNCHER = """
import atexit, json, os, resource, runpy, sys, time
from torch.optim.optimizer import register_optimizer_step_post_hook
began, ends, faults, profiled = time.perf_counter(), [], [], {}
profile_from, profile_steps = map(int, os.environ.get("VS_PROFILE", "0,0").split(","))
def step_ended(*_):
    ends.append(time.perf_counter())
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
    if profile_steps and len(ends) == profile_from:
        import torch.profiler
        profiled["profiler"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        profiled["profiler"].start()
    elif profile_steps and len(ends) == profile_from + profile_steps:
        profiled["profiler"].stop()
        profiled["ops"] = [{"op": e.key, "self_ms": e.self_cpu_time_total / 1e3 / profile_steps,
                            "calls": e.count / profile_steps} for e in profiled.pop("profiler").key_averages()]
        profiled["step_s"] = (ends[-1] - ends[-1 - profile_steps]) / profile_steps
register_optimizer_step_post_hook(step_ended)
def peak_rss_mib():  # VmHWM: ru_maxrss on Linux carries the bench's own peak into each child it starts
    try:
        with open("/proc/self/status") as status:
            return next(int(l.split()[1]) for l in status if l.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
def dump():
    with open(os.environ["VS_TIMES"], "w") as f:
        json.dump({"ends": ends, "faults": faults, "wall": time.perf_counter() - began, "profile": profiled,
                   "peak_rss_mib": peak_rss_mib()}, f)
atexit.register(dump)
target, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
if target.endswith(".py"):
    sys.path.insert(0, os.path.dirname(target))
    runpy.run_path(target, run_name="__main__")
else:
    runpy.run_module(target, run_name="__main__", alter_sys=True)
"""

def write_model(family_name: str, path: Path) -> Path:
    """A random-weight model of the family as one fp16 single file (kept between invocations with ``--work``)."""
    if path.is_file():
        return path
    import torch

    from sd_scripts_compat.facts.families import get_family
    from sd_scripts_compat.models.build import build_modules
    from sd_scripts_compat.models.single_file import save_single_file

    save_single_file(build_modules(get_family(family_name), seed=0), path, dtype=torch.float16)
    return path


def write_config(work: Path, model: Path, resolution: int, steps: int, precision: str) -> tuple[Path, Path]:
    """config.toml + dataset.toml both engines read (only ``output_dir`` differs, given on the command line)."""
    import toml

    dataset = work / "dataset.toml"
    subsets = [{"image_dir": str(folder), "num_repeats": int(folder.name.split("_", 1)[0])}
               for folder in sorted(DATASET.iterdir()) if folder.is_dir() and folder.name.split("_", 1)[0].isdigit()]
    dataset.write_text(toml.dumps({"general": {"caption_extension": ".txt", "enable_bucket": False},
                                   "datasets": [{"resolution": resolution, "batch_size": 1, "subsets": subsets}]}))
    config = work / f"config-{precision}.toml"
    config.write_text(toml.dumps({
        "pretrained_model_name_or_path": str(model), "dataset_config": str(dataset), "network_module": "networks.lora",
        "network_dim": 8, "network_alpha": 8, "network_train_unet_only": True, "optimizer_type": "AdamW",
        "learning_rate": 1e-4, "lr_scheduler": "constant", "max_train_steps": steps, "cache_latents": True,
        "mixed_precision": precision, "save_precision": "float", "sdpa": True, "seed": 42,
        "max_data_loader_n_workers": 0, "save_model_as": "safetensors", "output_name": "lora",
        "max_grad_norm": 1.0}))
    return config, dataset


def write_plan(work: Path, model: Path, resolution: int, steps: int) -> tuple[Path, dict]:
    """``autotune plan``'s config for this machine (resolution and rank pinned as the recipe's), on a copy of the
    example dataset; the config and the plan's settings."""
    import shutil

    import toml

    dataset, out = work / "planned-dataset", work / "planned-plan"
    if not dataset.is_dir():
        shutil.copytree(DATASET, dataset)
    command = [sys.executable, "-m", "autotune", "plan", str(dataset), "--model", str(model), "--resolution",
               str(resolution), "--rank", "8", "--steps", str(steps), "--no-learn", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"autotune plan failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    config = out / "config.toml"
    return config, toml.loads(config.read_text())


def plan_summary(plan: dict) -> str:
    """The plan's settings that differ in kind from the recipe's, in words."""
    return (f"micro-batch {plan.get('train_batch_size', 1)} x {plan.get('gradient_accumulation_steps', 1)}, "
            f"{plan.get('mixed_precision', 'no')}, {plan.get('optimizer_type', 'AdamW')}, "
            f"{'UNet only' if plan.get('network_train_unet_only') else 'text encoder trained too'}, "
            f"buckets {'on' if plan.get('enable_bucket') else 'off'}, "
            f"gradient checkpointing {'on' if plan.get('gradient_checkpointing') else 'off'}")


def images_per_step(settings: dict) -> int:
    return int(settings.get("train_batch_size", 1)) * int(settings.get("gradient_accumulation_steps", 1))


def wait_for_quiet(limit: float, timeout_s: float = 300.0) -> float:
    deadline = time.monotonic() + timeout_s
    while os.getloadavg()[0] > limit and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


def run_side(side: str, config: Path, out: Path, install: dict[str, str], tokenizers: Path | None,
             profile: str | None = None) -> dict:
    """One run of ``side`` (ours, sd-scripts or the bare loop) under the launcher; its step times, wall time, peak
    RSS, LoRA file and, with ``profile`` ("FIRST,COUNT"), the operators of steps FIRST+1..FIRST+COUNT."""
    out.mkdir(parents=True, exist_ok=True)
    times = out / "times.json"
    if side == "sd-scripts":
        command = [install["python"], "-c", LAUNCHER, str(Path(install["scripts"]) / "train_network.py")]
        cwd = Path(install["scripts"])
    else:
        engine = side in ("ours", "planned")
        target = "sd_scripts_compat.train_network" if engine else str(ROOT / "bench" / "bare_step.py")
        command, cwd = [sys.executable, "-c", LAUNCHER, target], ROOT
    command += ["--config_file", str(config), "--output_dir", str(out)]
    if side == "sd-scripts" and tokenizers is not None:
        command += ["--tokenizer_cache_dir", str(tokenizers)]
    env = {**os.environ, "VS_TIMES": str(times), "HF_HUB_OFFLINE": "1", **({"VS_PROFILE": profile} if profile else {})}
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0 or not times.is_file():
        raise SystemExit(f"{side} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    record = json.loads(times.read_text())
    ends = record["ends"]
    faults = record["faults"]
    return {"step_seconds": [b - a for a, b in zip(ends[TIMED_FROM - 1:], ends[TIMED_FROM:])],
            "page_faults_per_step": (faults[-1] - faults[TIMED_FROM - 1]) / max(1, len(faults) - TIMED_FROM),
            "wall_s": record["wall"], "peak_rss_mib": record["peak_rss_mib"], "lora": str(out / "lora.safetensors"),
            "profile": record["profile"]}


def modules(path: str) -> dict[str, list[int]]:
    from safetensors import safe_open

    with safe_open(path, "pt") as file:
        return {key: list(file.get_slice(key).get_shape()) for key in file.keys()}


def compare(precision: str, rounds: list[dict[str, dict]]) -> dict:
    """The paired figures of one precision: each side's median s/step, and ours / sd-scripts (and ours / bare
    loop) per round, medians over rounds."""
    def per_step(side: str) -> list[float]:
        return [statistics.median(r[side]["step_seconds"]) for r in rounds]

    ours, theirs = per_step("ours"), per_step("sd-scripts")
    first = rounds[0]
    row = {"precision": precision, "ours_s": statistics.median(ours), "sd_scripts_s": statistics.median(theirs),
           "step_ratio": statistics.median(o / k for o, k in zip(ours, theirs)),
           "step_ratios": [o / k for o, k in zip(ours, theirs)],
           "wall_ratio": statistics.median(r["ours"]["wall_s"] / r["sd-scripts"]["wall_s"] for r in rounds),
           "rss_ratio": statistics.median(r["ours"]["peak_rss_mib"] / r["sd-scripts"]["peak_rss_mib"] for r in rounds),
           "pairs": len(rounds), "same_modules": modules(first["ours"]["lora"]) == modules(first["sd-scripts"]["lora"]),
           "modules": len(modules(first["ours"]["lora"])), "runs": rounds}
    if "bare" in first:
        bare = per_step("bare")
        row |= {"bare_s": statistics.median(bare), "bare_ratio": statistics.median(o / b for o, b in zip(ours, bare))}
    if "planned" in first:  # the recipe trains one image per step; the plan's step trains `batch`
        batch = first["planned"]["images_per_step"]
        planned = [s / batch for s in per_step("planned")]
        row |= {"planned_batch": batch, "planned_image_s": statistics.median(planned),
                "planned_image_ratio": statistics.median(p / k for p, k in zip(planned, theirs)),
                "planned_wall_image_ratio": statistics.median(
                    r["planned"]["wall_s"] / batch / r["sd-scripts"]["wall_s"] for r in rounds)}
    if "planned-bare" in first:  # the floor at the plan's micro-batch
        floor = [s / first["planned-bare"]["images_per_step"] for s in per_step("planned-bare")]
        row |= {"floor_batch": first["planned-bare"]["images_per_step"], "floor_image_s": statistics.median(floor),
                "floor_image_ratio": statistics.median(f / k for f, k in zip(floor, theirs))}
    return row


def print_rows(rows: list[dict], family: str, resolution: int, steps: int) -> None:
    bare = "bare_s" in rows[0]
    print(f"\n{family} random weights, {resolution} px, batch 1, rank 8, UNet only, AdamW, cached latents; "
          f"steps {TIMED_FROM + 1}..{steps} timed; ratios are the median of the alternating rounds' ours / other")
    print("| precision | rounds | ours s/step | sd-scripts s/step | step ratio (per round) |"
          + (" bare loop s/step | ours / bare |" if bare else "") + " wall ratio | peak RSS ratio | same modules |")
    print("|---|---|---|---|---|" + ("---|---|" if bare else "") + "---|---|---|")
    for r in rows:
        rounds = " ".join(f"{x:.2f}" for x in r["step_ratios"])
        print(f"| {r['precision']} | {r['pairs']} | {r['ours_s']:.3f} | {r['sd_scripts_s']:.3f} | "
              f"**{r['step_ratio']:.2f}** ({rounds}) | "
              + (f"{r['bare_s']:.3f} | {r['bare_ratio']:.2f} | " if bare else "")
              + f"{r['wall_ratio']:.2f} | {r['rss_ratio']:.2f} | "
              f"{'yes' if r['same_modules'] else 'NO'} ({r['modules']} tensors) |")
    for r in (r for r in rows if "planned_batch" in r):
        print(f"\n{r['precision']}, our engine at the plan's settings ({r['planned_settings']}) against sd-scripts at "
              f"the recipe: {r['planned_image_s']:.3f} vs "
              f"{r['sd_scripts_s']:.3f} s per image at the steady step, ratio **{r['planned_image_ratio']:.2f}**; "
              f"whole run's wall time per image trained, ratio {r['planned_wall_image_ratio']:.2f}")
        if "floor_batch" in r:
            print(f"the bare loop at the plan's micro-batch {r['floor_batch']} and precision (UNet only, nothing "
                  f"else: the floor per image at that batch): {r['floor_image_s']:.3f} s per image, ratio "
                  f"**{r['floor_image_ratio']:.2f}** against sd-scripts at the recipe")


def print_profiles(precision: str, profiles: dict[str, dict], top: int) -> None:
    """The operators of the profiled steps side by side: self CPU ms per step and calls per step, the ``top``
    largest on any side, then everything else and the whole step."""
    sides = list(profiles)
    table = {side: {op["op"]: op for op in profiles[side]["ops"]} for side in sides}
    names = sorted({name for ops in table.values() for name in ops},
                   key=lambda name: -max(table[s].get(name, {"self_ms": 0})["self_ms"] for s in sides))
    print(f"\n{precision}: self CPU ms per step (calls per step), the profiled steps of one run per side")
    print("| operator | " + " | ".join(sides) + " |")
    print("|---|" + "---|" * len(sides))
    for name in names[:top]:
        cells = [f"{table[s][name]['self_ms']:.1f} ({table[s][name]['calls']:g})" if name in table[s] else "-"
                 for s in sides]
        print(f"| {name} | " + " | ".join(cells) + " |")
    rest = [sum(op["self_ms"] for n, op in table[s].items() if n not in names[:top]) for s in sides]
    print("| everything else | " + " | ".join(f"{r:.1f}" for r in rest) + " |")
    print("| operators, all | " + " | ".join(f"{sum(op['self_ms'] for op in table[s].values()):.1f} "
                                         f"({sum(op['calls'] for op in table[s].values()):g})" for s in sides) + " |")
    print("| step (profiled, wall) | " + " | ".join(f"{profiles[s]['step_s'] * 1e3:.1f}" for s in sides) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="sd15", help="sd15 (default) or sdxl")
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run (the first two warm up)")
    parser.add_argument("--pairs", type=int, default=5, help="rounds (one run of each side, alternating order)")
    parser.add_argument("--sides", default="ours,sd-scripts,bare",
                        help="ours, sd-scripts, bare (the bare loop, bench/bare_step.py), comma-separated")
    parser.add_argument("--precision", default="no,bf16", help="mixed_precision values, comma-separated")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="after the rounds, one more run per side profiling STEPS steps after the warm-up")
    parser.add_argument("--top", type=int, default=25, help="operators in the profile table")
    parser.add_argument("--planned", action="store_true",
                        help="also run our engine at the settings `autotune plan` chooses here (time per image)")
    parser.add_argument("--quiet-load", type=float, default=0.5, help="wait until the 1-minute load is below this")
    parser.add_argument("--work", help="keep the model file and runs here (default: a temporary folder)")
    parser.add_argument("--json", help="also write every figure to this file")
    args = parser.parse_args()
    sides = [side.strip() for side in args.sides.split(",") if side.strip()]
    scripts = os.environ.get(SCRIPTS_ENV)
    if "sd-scripts" in sides and not scripts:
        print(f"{SCRIPTS_ENV} is not set: point it at an sd-scripts checkout (and {PYTHON_ENV} at its Python) to "
              "compare, or leave sd-scripts out of --sides; nothing was run", file=sys.stderr)
        return 0
    from autotune.recovery.sd_scripts import find_install, tokenizer_cache
    from sd_scripts_compat.facts.families import get_family

    install = {}
    if "sd-scripts" in sides:
        found = find_install(Path(scripts).expanduser(), os.environ.get(PYTHON_ENV))
        install = {"scripts": str(found.scripts_dir), "python": str(found.python)}
    work = Path(args.work).expanduser() if args.work else Path(tempfile.mkdtemp(prefix="vs-sd-scripts-"))
    work.mkdir(parents=True, exist_ok=True)
    family = get_family(args.family)
    model = write_model(args.family, work / f"{args.family}-random.safetensors")
    pads = tuple(str(te.tokenizer.get("pad_token") or "<|endoftext|>") for te in family.text_encoders)
    tokenizers = tokenizer_cache(work, family.single_file_layout, pads)
    rows, steps = [], max(args.steps, TIMED_FROM + 1 + args.profile)
    plan_config, plan = write_plan(work, model, args.resolution, steps) if args.planned else (None, {})
    if args.planned:
        print(f"the plan: {plan_config} ({plan_summary(plan)})", file=sys.stderr)
    for precision in args.precision.split(","):
        config, _ = write_config(work, model, args.resolution, steps, precision)
        planned = ["planned"] + (["planned-bare"] if "bare" in sides else [])
        row_sides = sides + (planned if plan.get("mixed_precision") == precision else [])
        rounds = []
        for index in range(args.pairs):
            result = {}
            for side in row_sides[index % len(row_sides):] + row_sides[:index % len(row_sides)]:  # each leads in turn
                load = wait_for_quiet(args.quiet_load)
                side_config = plan_config if side in planned else config
                result[side] = run_side(side, side_config, work / f"{precision}-{index}-{side}", install, tokenizers)
                result[side]["images_per_step"] = {"planned": images_per_step(plan), "planned-bare": int(
                    plan.get("train_batch_size", 1))}.get(side, 1)  # the bare loop steps once per micro-batch
                print(f"{precision} round {index + 1} {side}: {statistics.median(result[side]['step_seconds']):.3f} "
                      f"s/step, {result[side]['page_faults_per_step']:.0f} page faults/step, "
                      f"{result[side]['wall_s']:.0f} s wall (load before {load:.2f})", file=sys.stderr,
                      flush=True)
            rounds.append(result)
        if "ours" in sides and "sd-scripts" in sides:
            rows.append(compare(precision, rounds))
            if "planned" in row_sides:
                rows[-1]["planned_settings"] = plan_summary(plan)
        else:
            rows.append({"precision": precision, "runs": rounds, "median_s": {
                side: statistics.median(statistics.median(r[side]["step_seconds"]) for r in rounds)
                for side in row_sides}})
            print(f"{precision}: median s/step " + ", ".join(f"{k} {v:.3f}" for k, v in rows[-1]["median_s"].items()))
        if args.profile:
            profiles = {side: run_side(side, config, work / f"{precision}-profile-{side}", install, tokenizers,
                                       profile=f"{TIMED_FROM + 1},{args.profile}")["profile"] for side in sides}
            rows[-1]["profiles"] = profiles
            print_profiles(precision, profiles, args.top)
    if "step_ratio" in rows[0]:
        print_rows(rows, args.family, args.resolution, args.steps)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
