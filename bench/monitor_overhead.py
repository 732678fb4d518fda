"""What the engine's background monitor costs: seconds per step with ``monitor.jsonl`` sampling on vs off.

Each run is ``python -m sd_scripts_compat.train_network`` on builtin:tiny-sd15 over examples/dataset in its own
process, with ``--autotune_monitor_seconds INTERVAL`` (on) or ``0`` (off); a step's time is the engine's own
(done.json ``step_seconds``: host clock between optimizer steps, warm-up steps left out). Runs alternate in
pairs, the side that goes first swapping each pair, because this shared VM drifts 10-20% over minutes; the
table gives each pair's medians and their ratio, and the median ratio over pairs (on / off: 1.00 = free).

    python bench/monitor_overhead.py                          # 4 pairs of 30 steps at 64 px, 2 s interval
    python bench/monitor_overhead.py --pairs 2 --steps 20 --interval 0.5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import toml

ROOT = Path(__file__).resolve().parents[1]


def run_once(work: Path, name: str, *, steps: int, resolution: int, interval: float) -> float:
    """One engine run; the median of its steady-state step times (seconds)."""
    folder = work / name
    folder.mkdir(parents=True)
    config = folder / "config.toml"
    config.write_text(toml.dumps({
        "pretrained_model_name_or_path": "builtin:tiny-sd15", "train_data_dir": str(ROOT / "examples" / "dataset"),
        "output_dir": str(folder / "out"), "output_name": "lora", "resolution": f"{resolution},{resolution}",
        "caption_extension": ".txt", "train_batch_size": 2, "max_train_steps": steps, "network_dim": 4,
        "network_alpha": 4, "learning_rate": 1e-4, "seed": 1, "cache_latents": True, "network_train_unet_only": True,
        "max_data_loader_n_workers": 0}), encoding="utf-8")
    events = folder / "events"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "sd_scripts_compat.train_network", "--config_file", str(config),
                    "--autotune_events_dir", str(events), "--autotune_monitor_seconds", f"{interval:g}"],
                   cwd=ROOT, env=env, check=True, capture_output=True, timeout=1800)
    done = json.loads((events / "done.json").read_text())
    if interval > 0:
        assert (events / "monitor.jsonl").stat().st_size > 0, "the monitor wrote nothing"
    else:
        assert not (events / "monitor.jsonl").exists(), "the monitor ran although off"
    return statistics.median(done["step_seconds"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--interval", type=float, default=2.0, help="the monitor's seconds between samples")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="monitor-bench-") as tmp:
        for pair in range(args.pairs):
            order = ("on", "off") if pair % 2 == 0 else ("off", "on")
            times = {side: run_once(Path(tmp), f"{pair}-{side}", steps=args.steps, resolution=args.resolution,
                                    interval=args.interval if side == "on" else 0.0) for side in order}
            rows.append((pair + 1, "/".join(order), times["on"], times["off"], times["on"] / times["off"]))
            print(f"pair {pair + 1}: on {times['on']:.4f} s/step, off {times['off']:.4f} s/step", file=sys.stderr)
    print(f"monitor overhead: tiny-sd15, {args.resolution} px, batch 2, cached latents, {args.steps} steps per run, "
          f"monitor every {args.interval:g} s")
    print("| pair | order | on s/step | off s/step | on / off |")
    print("|---|---|---|---|---|")
    for pair, order, on, off, ratio in rows:
        print(f"| {pair} | {order} | {on:.4f} | {off:.4f} | {ratio:.3f} |")
    ratios = [row[4] for row in rows]
    print(f"| median | | {statistics.median(r[2] for r in rows):.4f} | {statistics.median(r[3] for r in rows):.4f} "
          f"| {statistics.median(ratios):.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
