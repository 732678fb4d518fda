"""Trace musubi-tuner's latent-caching step for every family it trains (the family's VAE encoding one sample, on
fake tensors: nothing is downloaded) and store each fit in ``autotune/data/dit_calibration.json``
(``variants[F]["latent_caching"]``: the VAE's weights, and the encode transient as ``a + b x pixels`` for images
and, for the video families' clips, with a term in the frames). Prints each fit beside a held-out trace at another
size.

    python bench/calibrate_latent_caching.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
HELD_OUT = {"image": (768, 1), "clip": (640, 49)}


def main() -> int:
    from autotune.calibration.dit_memtrace import fit_latent_caching, trace_latent_caching
    from autotune.estimate.dit_memory import DIT_CALIBRATION_PATH, DitMemoryInputs, latent_caching_bytes
    from sd_scripts_compat.facts.families import family_names, get_family

    calibration = json.loads(DIT_CALIBRATION_PATH.read_text(encoding="utf-8"))
    print("| family | sample | weights GiB | held-out traced GiB | fit GiB | fit / traced |")
    print("|---|---|---|---|---|---|")
    for spec in map(get_family, family_names()):
        if spec.trainer != "musubi-tuner" or spec.name not in calibration.get("variants", {}):
            continue
        fit = fit_latent_caching(spec)
        calibration["variants"][spec.name]["latent_caching"] = fit
        fit_only = {"latent_caching": fit}
        for mode, (side, frames) in HELD_OUT.items():
            if mode not in fit:
                continue
            traced = trace_latent_caching(spec, side, frames)
            inputs = DitMemoryInputs(family=spec.name, resolution=side, frames=frames)
            predicted = latent_caching_bytes(fit_only, inputs)
            actual = traced["weights_bytes"] + traced["transient_bytes"]
            print(f"| {spec.name} | {side} px x {frames} | {fit['weights_bytes'] / 2**30:.3f} | {actual / 2**30:.3f} | "
                  f"{predicted / 2**30:.3f} | {predicted / actual:.3f} |")
    DIT_CALIBRATION_PATH.write_text(json.dumps(calibration, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {DIT_CALIBRATION_PATH}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
