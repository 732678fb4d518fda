"""Engine speed and memory on this machine: our trainer vs a plain diffusers + peft loop.

Each case runs in its own process (so peak RSS is that run's alone): ours through
``python -m sd_scripts_compat.train_network`` with a generated kohya config, the baseline through
``python bench/engine.py --baseline ...``, a textbook diffusers + peft LoRA loop of the same model,
targets, data, resolution, batch, optimizer and caching.

Both sides are timed the same way: the host clock at the end of every optimizer step; a step's time is
the gap to the previous step's end, the first (warm-up) steps left out. This machine is a shared VM
whose speed drifts by 10-20% over seconds to minutes (a plain matmul loop shows the same), so every case
runs several times, ours and the baseline alternating. The table gives each side's median step time over
all repeats, and the median over repeats of the paired ratio (ours / the baseline run right after it),
which cancels slow drift; ``--json`` adds the means and every step.
Prints a table; ``--json FILE`` also writes the figures.

    python bench/engine.py                 # tiny-sd15, tiny-sdxl at 256 and 512 px, sd15 at 256 px, caching on/off
    python bench/engine.py --quick         # tiny models only
    python bench/engine.py --models tiny-sd15,tiny-sdxl --resolutions 256,512 --repeats 2 --steps 8

``--cpu-bf16`` times our engine alone on the CPU in fp32 and under bf16 autocast (``mixed_precision = "bf16"``),
same model and settings, alternating; on a CPU with native bf16 (avx512_bf16 / AMX) the planner chooses bf16.

``--detection`` times our engine alone on tiny-sd15 with cached latents, with the instability checks
(the default) and without them (``SD_COMPAT_NO_DIVERGENCE_CHECK=1``, read by the engine for this bench
only), alternating which side runs first; the paired ratio is with / without of each repeat's medians.

The tiny twins' VAEs downsample 8x, like the full-size ones: at 256 px they train on the 32x32 latents that
256 px gives sd15, at 512 px on the 64x64 latents of sd15 at its native size.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATASET = ROOT / "examples" / "dataset"
WARMUP_STEPS = 2
# kohya's UNet LoRA targets: every Linear / 1x1 conv inside Transformer2DModel blocks
PEFT_TARGETS = r".*attentions.*\.(to_q|to_k|to_v|to_out\.0|proj_in|proj_out|ff\.net\.0\.proj|ff\.net\.2)$"
DEFAULT_RESOLUTIONS = {"tiny-sd15": (256, 512), "tiny-sdxl": (256, 512), "sd15": (256,)}


def our_run(model: str, resolution: int, cache: bool, steps: int, workdir: Path,
            env_extra: dict | None = None, mixed_precision: str = "no", extra: tuple[str, ...] = ()) -> dict:
    """One run of our engine (``autotune bench``'s config and command line: ``launch.bench``); its step times."""
    from autotune.launch.bench import engine_argv, measured_run_config
    from sd_scripts_compat.facts.families import get_family

    config = measured_run_config(workdir / "config.toml", model=f"builtin:{model}", dataset=DATASET,
                                 output_dir=workdir / "out", resolution=resolution, steps=steps + WARMUP_STEPS,
                                 cache_latents=cache, mixed_precision=mixed_precision)
    events = workdir / "events"
    subprocess.run(engine_argv(get_family(model).engine_module, config, events, extra=extra), check=True,
                   capture_output=True, text=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1",
                                                                 **(env_extra or {})})
    done = json.loads((events / "done.json").read_text())
    return {"step_seconds": done["step_seconds"], "peak_rss_mib": done["peak_memory"],
            "monitor_bytes": (events / "monitor.jsonl").stat().st_size if (events / "monitor.jsonl").exists() else 0}


def baseline_run(model: str, resolution: int, cache: bool, steps: int) -> dict:
    """A plain diffusers + peft LoRA loop (UNet only), the way diffusers' training examples write it."""
    import torch
    import torch.nn.functional as F
    from diffusers import DDPMScheduler
    from peft import LoraConfig
    from PIL import Image

    from sd_scripts_compat.facts.families import get_family
    from sd_scripts_compat.models.build import build_modules

    torch.manual_seed(1)
    bundle = build_modules(get_family(model))
    unet, vae = bundle.unet, bundle.vae
    unet.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=PEFT_TARGETS))
    params = [p for p in unet.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    scheduler = DDPMScheduler.from_config(bundle.scheduler_config)
    images, captions = [], []
    for path in sorted(DATASET.rglob("*")):
        if path.suffix.lower() in (".png", ".jpg", ".jpeg"):
            image = Image.open(path).convert("RGB").resize((resolution, resolution))
            images.append(torch.from_numpy(__import__("numpy").asarray(image).copy()).permute(2, 0, 1) / 127.5 - 1)
            captions.append(path.with_suffix(".txt").read_text().strip() if path.with_suffix(".txt").exists() else "")
    with torch.no_grad():
        cached = [vae.encode(img[None]).latent_dist.sample() * vae.config.scaling_factor for img in images] \
            if cache else None

    def encode_text(caption: str):
        with torch.no_grad():
            ids = [tok(caption, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
                   for tok in bundle.tokenizers]
            if not bundle.family.is_sdxl:
                return bundle.text_encoders[0](ids[0]).last_hidden_state, None
            out1 = bundle.text_encoders[0](ids[0], output_hidden_states=True)
            out2 = bundle.text_encoders[1](ids[1], output_hidden_states=True)
            hidden = torch.cat([out1.hidden_states[-2], out2.hidden_states[-2]], dim=-1)
            time_ids = torch.tensor([[resolution, resolution, 0, 0, resolution, resolution]], dtype=hidden.dtype)
            return hidden, {"text_embeds": out2.text_embeds, "time_ids": time_ids}

    unet.train()
    step_ended_at = []
    for step in range(steps + WARMUP_STEPS):
        index = step % len(images)
        if cached is not None:
            latents = cached[index]
        else:
            with torch.no_grad():
                latents = vae.encode(images[index][None]).latent_dist.sample() * vae.config.scaling_factor
        hidden, added = encode_text(captions[index])
        noise = torch.randn_like(latents)
        timesteps = torch.randint(0, 1000, (1,))
        noisy = scheduler.add_noise(latents, noise, timesteps)
        prediction = unet(noisy, timesteps, hidden, added_cond_kwargs=added).sample
        loss = F.mse_loss(prediction.float(), noise.float())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_ended_at.append(time.time())
    step_seconds = [b - a for a, b in zip(step_ended_at[WARMUP_STEPS - 1:], step_ended_at[WARMUP_STEPS:])]
    return {"step_seconds": step_seconds, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_baseline_in_child(model: str, resolution: int, cache: bool, steps: int) -> dict:
    command = [sys.executable, __file__, "--baseline", model, str(resolution), str(int(cache)), str(steps)]
    result = subprocess.run(command, check=True, capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return json.loads(result.stdout.strip().splitlines()[-1])


def summarize(runs: list[dict]) -> dict:
    """Median and mean step time over every timed step of every repeat; peak RSS of the largest run."""
    steps = [t for run in runs for t in run["step_seconds"]]
    return {"median_s": statistics.median(steps), "mean_s": statistics.mean(steps), "timed_steps": len(steps),
            "peak_rss_mib": max(run["peak_rss_mib"] for run in runs)}


def detection_cost(resolution: int, steps: int, repeats: int) -> dict:
    """Our step time on tiny-sd15 (cached latents) with and without the instability checks, paired per repeat."""
    off = {"SD_COMPAT_NO_DIVERGENCE_CHECK": "1"}
    runs: dict[str, list[dict]] = {"with": [], "without": []}
    for repeat in range(repeats):
        order = ("with", "without") if repeat % 2 == 0 else ("without", "with")
        for side in order:
            with tempfile.TemporaryDirectory() as tmp:
                runs[side].append(our_run("tiny-sd15", resolution, True, steps, Path(tmp),
                                          env_extra=None if side == "with" else off))
    paired = [statistics.median(a["step_seconds"]) / statistics.median(b["step_seconds"])
              for a, b in zip(runs["with"], runs["without"], strict=True)]
    return {"resolution": resolution, "with": summarize(runs["with"]), "without": summarize(runs["without"]),
            "paired_ratios": paired, "paired_ratio": statistics.median(paired), "runs": runs}


def monitor_cost(resolution: int, steps: int, repeats: int, interval: float) -> dict:
    """Our step time on tiny-sd15 (cached latents) with the background monitor sampling every ``interval`` s
    against it off (``--autotune_monitor_seconds 0``), paired per repeat, the side going first alternating."""
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for repeat in range(repeats):
        order = ("on", "off") if repeat % 2 == 0 else ("off", "on")
        for side in order:
            seconds = interval if side == "on" else 0.0
            with tempfile.TemporaryDirectory() as tmp:
                run = our_run("tiny-sd15", resolution, True, steps, Path(tmp),
                              extra=("--autotune_monitor_seconds", f"{seconds:g}"))
            if (run["monitor_bytes"] > 0) != (side == "on"):
                raise RuntimeError(f"the monitor {'wrote nothing' if side == 'on' else 'ran although off'}")
            runs[side].append(run)
    paired = [statistics.median(a["step_seconds"]) / statistics.median(b["step_seconds"])
              for a, b in zip(runs["on"], runs["off"], strict=True)]
    return {"resolution": resolution, "interval": interval, "on": summarize(runs["on"]),
            "off": summarize(runs["off"]), "paired_ratios": paired, "paired_ratio": statistics.median(paired),
            "runs": runs}


def print_monitor(row: dict) -> None:
    print(f"monitor overhead: tiny-sd15, {row['resolution']} px, cached latents, monitor every {row['interval']:g} s, "
          f"{len(row['paired_ratios'])} alternating repeats per side")
    print("| repeat | on s/step | off s/step | on / off |")
    print("|---|---|---|---|")
    for index, (on, off) in enumerate(zip(row["runs"]["on"], row["runs"]["off"], strict=True), 1):
        a, b = statistics.median(on["step_seconds"]), statistics.median(off["step_seconds"])
        print(f"| {index} | {a:.4f} | {b:.4f} | {a / b:.3f} |")
    print(f"| median | {row['on']['median_s']:.4f} | {row['off']['median_s']:.4f} | {row['paired_ratio']:.3f} |")


def print_detection(row: dict) -> None:
    ratio = row["with"]["median_s"] / row["without"]["median_s"]
    print(f"instability checks, tiny-sd15 {row['resolution']} px, cached latents, {len(row['paired_ratios'])} "
          "alternating repeats per side")
    print(f"{'with s/step':>11} {'without s/step':>14} {'ratio':>6} {'paired':>6} {'paired min..max':>16}")
    print(f"{row['with']['median_s']:>11.4f} {row['without']['median_s']:>14.4f} {ratio:>6.3f} "
          f"{row['paired_ratio']:>6.3f} {min(row['paired_ratios']):>7.3f}..{max(row['paired_ratios']):<7.3f}")


def cpu_bf16_rows(cases: list[tuple[str, int]], steps: int, repeats: int) -> list[dict]:
    """Our engine on the CPU in fp32 and under bf16 autocast (``mixed_precision = "bf16"``: frozen weights bf16,
    LoRA fp32), same model and settings, alternating which runs first; ratio = bf16 / fp32 step time."""
    rows = []
    for model, resolution in cases:
        runs: dict[str, list[dict]] = {"no": [], "bf16": []}
        for repeat in range(repeats):
            for precision in (("no", "bf16") if repeat % 2 == 0 else ("bf16", "no")):
                with tempfile.TemporaryDirectory() as tmp:
                    runs[precision].append(our_run(model, resolution, True, steps, Path(tmp),
                                                   mixed_precision=precision))
        fp32, bf16 = summarize(runs["no"]), summarize(runs["bf16"])
        paired = [statistics.median(b["step_seconds"]) / statistics.median(f["step_seconds"])
                  for f, b in zip(runs["no"], runs["bf16"], strict=True)]
        rows.append({"model": model, "resolution": resolution, "fp32": fp32, "bf16": bf16,
                     "ratio_of_medians": bf16["median_s"] / fp32["median_s"], "paired_ratios": paired,
                     "paired_ratio": statistics.median(paired), "runs": runs})
        print(f"| {model} | {resolution} | {fp32['median_s']:.4f} | {bf16['median_s']:.4f} | "
              f"{bf16['median_s'] / fp32['median_s']:.2f} | {statistics.median(paired):.2f} | "
              f"{fp32['peak_rss_mib']:.0f} | {bf16['peak_rss_mib']:.0f} |", flush=True)
    return rows


def bench_cases(models: str, resolutions: str | None, quick: bool) -> list[tuple[str, int]]:
    """(model, px) pairs in the order given; ``resolutions`` applies to every model, else its defaults."""
    names = [m.strip() for m in models.split(",") if m.strip()]
    if quick:
        names = [m for m in names if m.startswith("tiny")]
    chosen = tuple(int(r) for r in resolutions.split(",")) if resolutions else None
    return [(m, r) for m in names for r in (chosen or DEFAULT_RESOLUTIONS.get(m, (256,)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models only")
    parser.add_argument("--models", default=",".join(DEFAULT_RESOLUTIONS),
                        help="comma-separated built-in models (default: %(default)s)")
    parser.add_argument("--resolutions", default=None,
                        help="comma-separated px, for every model (default: tiny ones 256,512; sd15 256)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run for the tiny models (after warm-up)")
    parser.add_argument("--sd15-steps", type=int, default=4, help="timed steps per run for sd15 at 256 px")
    parser.add_argument("--repeats", type=int, default=5, help="runs per side and case for the tiny models")
    parser.add_argument("--sd15-repeats", type=int, default=3, help="runs per side and case for sd15")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--detection", action="store_true",
                        help="only our engine, with and without the instability checks (tiny-sd15, cached latents)")
    parser.add_argument("--monitor", action="store_true",
                        help="only our engine, with the background monitor (monitor.jsonl) on and off (tiny-sd15, "
                             "cached latents; --interval, --resolution, --steps, --repeats apply)")
    parser.add_argument("--interval", type=float, default=2.0, help="with --monitor: seconds between samples")
    parser.add_argument("--resolution", type=int, default=256,
                        help="with --detection or --monitor: the training resolution")
    parser.add_argument("--cpu-bf16", action="store_true",
                        help="only our engine on the CPU, fp32 against bf16 autocast (default models tiny-sd15,sd15 "
                             "at 256 px; --steps / --repeats apply)")
    parser.add_argument("--baseline", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.baseline:
        model, resolution, cache, steps = args.baseline
        print(json.dumps(baseline_run(model, int(resolution), bool(int(cache)), int(steps))))
        return 0
    if args.detection:
        row = detection_cost(args.resolution, args.steps, args.repeats)
        print_detection(row)
        if args.json:
            Path(args.json).write_text(json.dumps(row, indent=1))
        return 0
    if args.monitor:
        row = monitor_cost(args.resolution, args.steps, args.repeats, args.interval)
        print_monitor(row)
        if args.json:
            Path(args.json).write_text(json.dumps(row, indent=1))
        return 0
    if args.cpu_bf16:
        models = args.models if args.models != ",".join(DEFAULT_RESOLUTIONS) else "tiny-sd15,sd15"
        print(f"median seconds per step, batch 1, rank 4, UNet only, cached latents; {args.repeats} alternating runs "
              f"per side of {args.steps} timed steps\n")
        print("| model | px | fp32 s/step | bf16 s/step | bf16 / fp32 | paired | fp32 RSS MiB | bf16 RSS MiB |")
        print("|---|---|---|---|---|---|---|---|")
        rows = cpu_bf16_rows(bench_cases(models, args.resolutions or "256", args.quick), args.steps, args.repeats)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return 0
    cases = bench_cases(args.models, args.resolutions, args.quick)
    rows = []
    print(f"median seconds per step; runs per side: {args.repeats} (tiny), {args.sd15_repeats} (sd15), alternating")
    print(f"{'model':<10} {'px':>4} {'cache':>5} | {'ours s/step':>11} {'base s/step':>11} {'ratio':>6} "
          f"{'paired':>6} | {'ours RSS MiB':>12} {'base RSS MiB':>12}")
    for model, resolution in cases:
        steps, repeats = (args.steps, args.repeats) if model.startswith("tiny") else (args.sd15_steps,
                                                                                      args.sd15_repeats)
        for cache in (True, False):
            ours_runs, base_runs = [], []
            for _ in range(repeats):
                with tempfile.TemporaryDirectory() as tmp:
                    ours_runs.append(our_run(model, resolution, cache, steps, Path(tmp)))
                base_runs.append(run_baseline_in_child(model, resolution, cache, steps))
            ours, base = summarize(ours_runs), summarize(base_runs)
            ratio = ours["median_s"] / base["median_s"]
            paired = statistics.median(statistics.median(o["step_seconds"]) / statistics.median(b["step_seconds"])
                                       for o, b in zip(ours_runs, base_runs, strict=True))
            rows.append({"model": model, "resolution": resolution, "cache_latents": cache, "ours": ours,
                         "baseline": base, "ratio_of_medians": ratio, "ratio_of_means": ours["mean_s"] / base["mean_s"],
                         "paired_ratio": paired, "ours_runs": ours_runs, "baseline_runs": base_runs})
            print(f"{model:<10} {resolution:>4} {'on' if cache else 'off':>5} | {ours['median_s']:>11.4f} "
                  f"{base['median_s']:>11.4f} {ratio:>6.2f} {paired:>6.2f} | {ours['peak_rss_mib']:>12.0f} "
                  f"{base['peak_rss_mib']:>12.0f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
