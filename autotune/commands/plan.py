"""Plan LoRA training settings that fit a GPU: the fastest predicted configuration, and why.

Probes this machine's GPU(s) unless `--gpu NAME` (repeat it for several cards) or `--vram GB` says which card
to plan for; `--gpu NAME --vram GB` plans for that card with less memory. Prints every setting with its reason,
the predicted peak VRAM, it/s and total time; `--out DIR` writes config.toml + dataset.toml that sd-scripts'
train_network.py / sdxl_train_network.py accept unchanged (`--format lora-scripts` for lora-scripts' sectioned
layout). Answers in about a second: nothing is traced or built, the memory and speed models are analytic.
Where this machine has measured a setting (`autotune bench`, `autotune run`), the prediction uses the measurement
and says so ("measured", "measured-scaled" or "model"); a setting that ran out of memory here is not proposed.
`--no-learn` plans from the models alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from autotune.launch.plan_options import accept_pickle, add_arguments, build_request, render

__all__ = ["add_arguments", "run"]


def run(args: argparse.Namespace) -> int:
    from autotune.planning.planner import plan_training
    from autotune.planning.toml_writer import write_plan_files
    from sd_scripts_compat.facts.errors import UserError

    accept_pickle(args, "plan")
    if args.out:  # said before planning: --out never replaces a run's or the user's files, nor goes in the dataset
        from autotune.own_files import refuse_foreign_out, refuse_out_in_dataset

        refuse_out_in_dataset(Path(args.out), Path(args.dataset))
        refuse_foreign_out(Path(args.out))
    request = build_request(args)
    plan = plan_training(request)
    if not plan.fits:
        if args.json:
            print(json.dumps(plan.to_dict(), indent=2, sort_keys=True))
            return 1
        raise UserError(plan.message)
    written = write_plan_files(plan, args.out, args.format) if args.out else None
    if args.json:
        out = plan.to_dict()
        out["written"] = [str(p) for p in written] if written else []
        print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    render(plan)
    if written:
        print(f"wrote {written[0]} and {written[1]} "
              f"({plan.family.trainer if plan.family.trains_with.caches_apart else args.format} format)")
    else:
        print("add --out DIR to write config.toml and dataset.toml", file=sys.stderr)
    return 0
