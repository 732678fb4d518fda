"""Measured peak host RAM (RSS) of real runs on this machine beside the host-RAM model's prediction.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/ram_calibrate.py [--file SD15_FILE]   # or LORA_AUTOTUNE_SD15_FILE

Each measurement is a child process whose peak RSS comes from ``getrusage(RUSAGE_CHILDREN)`` of a wrapper:
the engine training builtin:tiny-sd15 (the process figure, ``PROCESS_BYTES``) and,
when the file exists, loading a real-size single file the way the engine does (the loading peak). The
constants in ``autotune/estimate/ram_model.py`` come from this table.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
PEAK_RSS = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
            "print('PEAK_KIB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)")


def peak_rss(argv: list[str]) -> int:
    out = subprocess.run([sys.executable, "-c", PEAK_RSS, *argv], capture_output=True, text=True, cwd=ROOT, env=ENV,
                         timeout=900, check=True).stdout
    return int(next(x for x in out.splitlines() if x.startswith("PEAK_KIB")).split()[1]) * 1024


def tiny_tensor_peak() -> int:
    """The VRAM model's tensor peak of the tiny run (held in RAM on a CPU)."""
    from autotune.estimate.memory_model import MemoryInputs, predict_memory

    return predict_memory(MemoryInputs(family="tiny-sd15", resolution=64, batch_size=2, rank=4,
                                       gradient_checkpointing=False, optimizer="AdamW", weight_dtype="fp32",
                                       train_text_encoder=True, cache_text_encoder_outputs=False)).tensor_peak_bytes


def tiny_run(workers: int) -> tuple[int, int]:
    from autotune.estimate.ram_model import RamInputs, predict_ram
    from autotune.launch.bench import engine_argv, measured_run_config

    with tempfile.TemporaryDirectory() as tmp:
        config = measured_run_config(Path(tmp, "c.toml"), model="builtin:tiny-sd15", dataset=ROOT / "examples" /
                                     "dataset", output_dir=Path(tmp, "out"), resolution=64, steps=20,
                                     train_batch_size=2, learning_rate=1e-3, seed=3, cache_latents=False,
                                     network_train_unet_only=False, max_data_loader_n_workers=workers)
        measured = peak_rss(engine_argv("sd_scripts_compat.train_network", config, Path(tmp, "events")))
    predicted = predict_ram(RamInputs(family="tiny-sd15", resolution=64, batch_size=2, num_images=4,
                                      num_workers=workers, weight_dtype="fp32", on_gpu=False,
                                      training_tensor_bytes=tiny_tensor_peak())).peak_bytes
    return measured, predicted


def file_load(path: Path, dtype: str) -> tuple[int, int]:
    """Loading ``path`` as the engine does, into ``dtype`` ("float32": a CPU plan; "bfloat16": a GPU plan)."""
    from autotune.estimate.ram_model import RamInputs, predict_ram

    code = ("import sys, torch; from sd_scripts_compat.runtimes import load_base_model; "
            "dtype = getattr(torch, sys.argv[2]); load_base_model(sys.argv[1], dtype=dtype, vae_dtype=dtype)")
    measured = peak_rss([sys.executable, "-c", code, str(path), dtype])
    predicted = predict_ram(RamInputs(family="sd15", resolution=512, batch_size=1, num_images=1, num_workers=0,
                                      model_file_bytes=path.stat().st_size, on_gpu=dtype != "float32",
                                      weight_dtype="fp32" if dtype == "float32" else "bf16")).peak_bytes
    return measured, predicted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = os.environ.get("LORA_AUTOTUNE_SD15_FILE")
    parser.add_argument("--file", type=Path, default=Path(default) if default else None,
                        help="a random-weight fp16 SD1.5 single file (default: $LORA_AUTOTUNE_SD15_FILE)")
    args = parser.parse_args(argv)
    # 0 workers: getrusage reports the largest single process, and workers are processes of their own
    rows = [("tiny-sd15 engine run, 0 workers", *tiny_run(0))]
    if args.file is not None and args.file.is_file():
        for dtype in ("float32", "bfloat16"):
            rows.append((f"load {args.file.name} ({args.file.stat().st_size / 2**30:.2f} GiB) into {dtype}",
                         *file_load(args.file, dtype)))
    print("| run | measured peak RSS MiB | predicted MiB | error |")
    print("|---|---|---|---|")
    for name, measured, predicted in rows:
        error = (predicted / measured - 1) * 100
        print(f"| {name} | {measured / 2**20:.0f} | {predicted / 2**20:.0f} | {error:+.1f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
