"""Compiled blocks (``torch_compile``) against eager on this machine: compile time, s/step, and where it pays.

    python bench/compile_blocks.py --model tiny-sd15 --resolution 256 --steps 8 --repeats 2 --backend inductor
    python bench/compile_blocks.py --model tiny-flux --resolution 64 --steps 50 --repeats 1 --held-out 0.25

Runs our engine (``autotune bench``'s config and command line) alternately eager and with ``torch_compile`` and
the given ``dynamo_backend``, each in its own process. Per side: the median steady s/step (steps 3..N), the whole
run's wall time, and for the compiled side the blocks and graphs compiled and any failure. The compile time is
the compiled run's wall time beyond the eager run's, less the steady-step difference times the steps; the
break-even is the step count after which the compiled run is ahead (none when compiled steps are not faster).
done.json's own compile seconds (dynamo's compile callbacks) are shown beside it. ``--held-out F`` keeps a fraction
F of the images out of training and prints each side's loss on them after the last step, and their difference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATASET = ROOT / "examples" / "dataset"


def one_run(model: str, resolution: int, steps: int, backend: str | None, work: Path, held_out: float = 0.0) -> dict:
    from autotune.launch.bench import engine_argv, measured_run_config
    from sd_scripts_compat.facts.families import get_family

    compiled = {"torch_compile": True, "dynamo_backend": backend} if backend else {}
    if held_out:
        compiled.update(validation_split=held_out, validate_every_n_steps=steps)
    config = measured_run_config(work / "config.toml", model=f"builtin:{model}", dataset=DATASET,
                                 output_dir=work / "out", resolution=resolution, steps=steps, **compiled)
    events = work / "events"
    done = subprocess.run(engine_argv(get_family(model).engine_module, config, events), capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        raise SystemExit(f"{backend or 'eager'} run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    record = json.loads((events / "done.json").read_text())
    held_out_loss = record.get("validation_loss") or [[None, None]]
    return {"s_per_step": statistics.median(record["step_seconds"]), "wall_s": record["seconds"],
            "torch_compile": record.get("torch_compile"), "held_out_loss": held_out_loss[-1][1],
            "stderr": done.stderr.strip()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-sd15", help="a built-in model (default: %(default)s)")
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run (the first two warm up)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per side, alternating")
    parser.add_argument("--backend", default="inductor", help="dynamo_backend of the compiled side")
    parser.add_argument("--held-out", type=float, default=0.0, help="fraction of images held out (default 0: none)")
    parser.add_argument("--json", help="also write every figure to this file")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"eager": [], "compiled": []}
    for repeat in range(args.repeats):
        for side in (("eager", "compiled") if repeat % 2 == 0 else ("compiled", "eager")):
            with tempfile.TemporaryDirectory() as tmp:
                runs[side].append(one_run(args.model, args.resolution, args.steps,
                                          args.backend if side == "compiled" else None, Path(tmp),
                                          args.held_out))
    eager = statistics.median(r["s_per_step"] for r in runs["eager"])
    compiled = statistics.median(r["s_per_step"] for r in runs["compiled"])
    compile_s = statistics.median(c["wall_s"] - e["wall_s"] for c, e in zip(runs["compiled"], runs["eager"])) \
        - (compiled - eager) * args.steps
    gain = eager - compiled
    summary = runs["compiled"][0]["torch_compile"]
    print(f"{args.model} {args.resolution} px, {args.steps} steps, {args.repeats} runs per side, backend "
          f"{args.backend}")
    print("| eager s/step | compiled s/step | compiled / eager | compile time s (done.json) | break-even steps | "
          "blocks | graphs | failure |")
    print("|---|---|---|---|---|---|---|---|")
    own = summary.get("seconds", 0)
    print(f"| {eager:.3f} | {compiled:.3f} | {compiled / eager:.2f} | {compile_s:.0f} ({own:.0f}) | "
          f"{f'{compile_s / gain:.0f}' if gain > 0 else 'never'} | {summary['blocks']} | {summary['graphs']} | "
          f"{summary['failure'] or '-'} |")
    if args.held_out:
        losses = {side: [r["held_out_loss"] for r in runs[side]] for side in runs}
        print(f"held-out loss after step {args.steps} (each run): eager {losses['eager']}, compiled "
              f"{losses['compiled']}; compiled / eager {losses['compiled'][0] / losses['eager'][0]:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"eager": eager, "compiled": compiled, "compile_s": compile_s,
                                               "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
