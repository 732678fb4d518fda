"""Sharding on a machine with several GPUs (issue 53's GPU part): the link the planner assumes against the link the
cards have, and our engine sharded against unsharded on the real collectives.

1. **The link.** Each of two processes (one per GPU, NCCL) all-gathers a bf16 buffer of ``--mib`` MiB as FSDP2 gathers
   a block, ``--repeats`` times after a warm-up; GB/s each process received, against what the speed model assumes
   for the gathers of a sharded transformer (``dit_speed.gather_seconds``: the link a plan on this machine takes,
   NVLink where the probe finds the two cards bridged, else their PCIe link as it runs; the catalogue's PCIe figure
   in a dry run; times the link efficiency). The predicted seconds of one FLUX.1-dev micro-step's gathers at that
   rate and at the measured one are printed side by side.
2. **The engine.** ``accelerate launch --num_processes 2`` of tiny-flux, unsharded, then ``fsdp = "full_shard"``, then
   that with the optimizer's state split too (``shard_optimizer_state``), the same seed: each LoRA's largest
   difference from the unsharded one (the CPU tests give 0 with gloo).

``--dry-run`` does both on this CPU with gloo (two processes, a small buffer): the script end to end; the figures
are a CPU's. Results: ``sharding.json`` in the output folder, and a table.

    python bench/gpu_sharding_check.py "$OUT"          # a machine with 2+ CUDA GPUs
    python bench/gpu_sharding_check.py --dry-run /tmp/s
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _gather_worker(rank: int, world: int, port: int, backend: str, mib: float, repeats: int, out: str) -> None:
    """One process: ``repeats`` all-gathers of a shard of ``mib`` / world MiB each into a ``mib`` MiB buffer."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    numel = int(mib * 2**20 / 2) // world * world
    shard = torch.ones(numel // world, dtype=torch.bfloat16, device=device)
    whole = torch.empty(numel, dtype=torch.bfloat16, device=device)
    dist.all_gather_into_tensor(whole, shard)  # warm-up: the communicator's set-up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        dist.all_gather_into_tensor(whole, shard)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    received = repeats * numel * 2 * (world - 1) / world
    if rank == 0:
        Path(out).write_text(json.dumps({"seconds": seconds, "received_bytes": received,
                                         "gbps": received / seconds / 1e9}), encoding="utf-8")
    dist.destroy_process_group()


def measure_link(dry_run: bool, mib: float, repeats: int) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from autotune.recovery.engine import free_port

    backend = "gloo" if dry_run else "nccl"
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "link.json")
        mp.spawn(_gather_worker, args=(2, free_port(), backend, mib, repeats, out), nprocs=2, join=True)
        return {"backend": backend, "mib": mib, "repeats": repeats, **json.loads(Path(out).read_text())}


def assumed_link(card: str | None, probed: bool) -> dict[str, Any]:
    """What the speed model assumes for the gathers of two processes: the link a plan on this machine takes (its
    probe: NVLink where the two cards are bridged, else their PCIe link as it runs; ``probed`` False: the catalogue
    card's PCIe) times the link efficiency, and one FLUX.1-dev micro-step's gathered bytes over two processes."""
    from autotune.estimate.dit_memory import dit_family_calibration, gathered_bytes_per_step
    from autotune.hardware.gpu_catalog import find_gpu
    from autotune.hardware.gpu_links import collective_gbps

    cal = dit_family_calibration("flux-dev")
    spec: Any = find_gpu(card) if card else None
    if probed:
        from autotune.hardware.probe import probe_system
        from autotune.launch.plan_options import targets_from_probe

        targets = targets_from_probe(probe_system(tempfile.mkdtemp()))[0]
        spec = targets[0].spec if targets else spec
    link = collective_gbps(spec, 2, cal["speed"]["default_pcie_gbps"])
    return {"card": card, "pcie_gbps": getattr(spec, "pcie_gbps", None),
            "nvlink_gbps": getattr(spec, "nvlink_gbps", None), "link_gbps": link,
            "efficiency": cal["speed"]["link_efficiency"],
            "assumed_gbps": link * cal["speed"]["link_efficiency"],
            "flux_bytes_per_micro_step": gathered_bytes_per_step(cal["architecture"], 2)}


def engine_equality(dry_run: bool) -> dict[str, Any]:
    """tiny-flux through accelerate on two processes, unsharded, sharded, sharded with the optimizer's state split:
    the LoRAs' largest differences from the unsharded one."""
    import toml

    from autotune.recovery.engine import free_port
    from sd_scripts_compat.network.lora_file import read_lora_file

    data = str(ROOT / "examples" / "dataset")
    values = {"pretrained_model_name_or_path": "builtin:tiny-flux", "train_data_dir": data, "output_name": "lora",
              "resolution": "64,64", "caption_extension": ".txt", "train_batch_size": 1,
              "max_train_steps": 4, "network_dim": 4, "network_alpha": 4, "learning_rate": 1e-2, "seed": 3,
              "max_data_loader_n_workers": 0, "network_train_unet_only": True, "cache_latents": True,
              "mixed_precision": "no" if dry_run else "bf16", "t5xxl_max_token_length": 16,
              "model_prediction_type": "raw", "timestep_sampling": "shift", "guidance_scale": 1.0}
    said = None
    with tempfile.TemporaryDirectory() as folder:
        files = {}
        sharded = {"fsdp": "full_shard"}
        for name, extra in (("plain", {}), ("sharded", sharded), ("state", {**sharded, "shard_optimizer_state": True})):
            config = Path(folder) / f"{name}.toml"
            config.write_text(toml.dumps({**values, **extra, "output_dir": str(Path(folder) / name)}))
            command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                       "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                       "--main_process_port", str(free_port()), "-m", "sd_scripts_compat.flux_train_network",
                       "--config_file", str(config)]
            done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=900,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1"})
            if done.returncode != 0:
                return {"error": f"{name}: exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"}
            files[name] = read_lora_file(Path(folder) / name / "lora.safetensors")[0]
            if name == "sharded":
                said = re.search(r"each holds ([\d.]+) of its ([\d.]+) MiB.*?(?:peak while sharding ([\d.]+) MiB)?$",
                                 done.stdout, re.MULTILINE)
        one, two, three = files["plain"], files["sharded"], files["state"]
        # the engine keeps the model on the host until each block is sharded: the card's peak then is the shares
        # and one block, never the whole model (None on a CPU)
        sharding = {"held_mib": float(said[1]), "whole_mib": float(said[2]),
                    "card_peak_while_sharding_mib": float(said[3]) if said[3] else None} if said else {}
        return {"tensors": len(one), **sharding,
                "max_abs_difference": max(float((one[k].float() - two[k].float()).abs().max()) for k in one),
                "state_split_max_abs_difference": max(float((one[k].float() - three[k].float()).abs().max())
                                                      for k in one)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default=os.environ.get("OUT") or str(ROOT / "bench" / "results" / "sharding"))
    parser.add_argument("--dry-run", action="store_true", help="this CPU, gloo, a small buffer")
    parser.add_argument("--mib", type=float, default=None, help="MiB gathered per repeat (default 512; dry-run 8)")
    parser.add_argument("--repeats", type=int, default=None, help="gathers timed (default 20; dry-run 3)")
    parser.add_argument("--card", default=None, help="the catalogue card the speed model assumes (default: GPU 0's)")
    args = parser.parse_args(argv)
    import torch

    if not args.dry_run and torch.cuda.device_count() < 2:
        print(f"gpu_sharding_check: {torch.cuda.device_count()} CUDA GPU(s) here; it needs 2 (or --dry-run)",
              file=sys.stderr)
        return 2
    card = args.card or (None if args.dry_run else torch.cuda.get_device_name(0))
    link = measure_link(args.dry_run, args.mib or (8.0 if args.dry_run else 512.0),
                        args.repeats or (3 if args.dry_run else 20))
    assumed = assumed_link(card, probed=not args.dry_run)
    engine = engine_equality(args.dry_run)
    result = {"dry_run": args.dry_run, "link": link, "assumed": assumed, "engine": engine}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sharding.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    step = assumed["flux_bytes_per_micro_step"]
    print("| backend | measured GB/s | assumed GB/s | measured / assumed | FLUX.1-dev gathers per micro-step, "
          "s (assumed / measured rate) | tiny-flux LoRA max |sharded - unsharded| | ... with the state split | "
          "card's peak while sharding / whole model, MiB |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {link['backend']} | {link['gbps']:.2f} | {assumed['assumed_gbps']:.2f} | "
          f"{link['gbps'] / assumed['assumed_gbps']:.2f} | {step / assumed['assumed_gbps'] / 1e9:.2f} / "
          f"{step / link['gbps'] / 1e9:.2f} | {engine.get('max_abs_difference', engine.get('error'))} | "
          f"{engine.get('state_split_max_abs_difference')} | "
          f"{engine.get('card_peak_while_sharding_mib')} / {engine.get('whole_mib')} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
