"""Regenerate ``templates/``: ready configs per family and VRAM tier, planned by the tuner itself.

    python -m autotune.planning.templates            # rewrites templates/ in the repository
    python -m autotune.planning.templates --out DIR  # writes elsewhere (the staleness test does this)

Each ``templates/<family>/<tier>gb/`` holds ``config.toml`` + ``dataset.toml`` (kohya format; for a family
musubi-tuner trains, its dataset TOML, ``--config_file`` and ``musubi_train.sh``) planned for a
card of that size with a generic Ampere card's rates (bf16), goal character, priority balanced, and a
stand-in dataset (``./train/10_subject``, 20 images); edit ``pretrained_model_name_or_path`` and the
dataset's ``image_dir``. Paths are relative, so the files do not depend on where they were generated.
A tier where nothing fits gets ``DOES_NOT_FIT.txt`` with the planner's message instead.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from autotune.planning.dataset import nominal_dataset
from autotune.planning.planner import Plan, plan_training
from autotune.planning.request import GIB, PlanRequest, gpu_from_vram
from autotune.planning.toml_writer import render_plan_files
from sd_scripts_compat.facts.atomic import write_text_atomic
from sd_scripts_compat.facts.families import FamilySpec, get_family

TEMPLATE_DIR = Path(__file__).resolve().parents[2] / "templates"
TIERS_GB = (6, 8, 12, 16, 24, 48)
# family -> the VRAM tiers it gets (FLUX: the tiers sd-scripts publishes figures for)
# the families sd-scripts trains beside them: 8-24 GB with 10 GB (the tier where swapping starts to matter)
DIT_TIERS = (8, 10, 12, 16, 24)
MUSUBI_TIERS = (12, 16, 24, 32)  # the families musubi-tuner trains: its README's 12 GB floor up to 32 GB
FAMILY_TIERS: dict[str, tuple[int, ...]] = {"sd15": TIERS_GB, "sd2": TIERS_GB, "sdxl": TIERS_GB,
                                            "flux-dev": DIT_TIERS, "chroma": DIT_TIERS, "sd3.5-medium": DIT_TIERS,
                                            "sd3.5-large": DIT_TIERS, "lumina2": DIT_TIERS,
                                            "hunyuan-image-2.1": DIT_TIERS, "anima": DIT_TIERS,
                                            **dict.fromkeys(("qwen-image", "flux2-dev", "flux2-klein-4b",
                                                             "flux2-klein-9b", "wan2.2-t2v-a14b", "wan2.1-t2v-1.3b",
                                                             "z-image"), MUSUBI_TIERS)}
FAMILIES = tuple(FAMILY_TIERS)
TEMPLATE_CPU_CORES = 8  # a typical desktop; only max_data_loader_n_workers depends on it
MODEL_PLACEHOLDER = "./models/{family}.safetensors"  # FLUX: ./models/flux-dev.safetensors (the transformer)


def template_plan(family: FamilySpec, tier_gb: int) -> Plan:
    """The plan a template holds (deterministic: no probe, no dataset scan, relative paths)."""
    request = PlanRequest(dataset_dir=None, model=MODEL_PLACEHOLDER.format(family=family.name), family=family,
                          gpus=(gpu_from_vram(tier_gb),), dataset=nominal_dataset(),
                          cpu_physical_cores=TEMPLATE_CPU_CORES,
                          probe_summary="none: template for a generic card of this size")
    return plan_training(request)


def template_files() -> dict[str, str]:
    """Relative path -> text of every template file."""
    files: dict[str, str] = {}
    rows = []
    for family in FAMILIES:
        for tier in FAMILY_TIERS[family]:
            folder = f"{family}/{tier}gb"
            plan = template_plan(get_family(family), tier)
            if not plan.fits:
                files[f"{folder}/DOES_NOT_FIT.txt"] = plan.message + "\n"
                rows.append(f"| {family} | {tier} | does not fit | | | | | |")
                continue
            files.update({f"{folder}/{name}": text for name, text in render_plan_files(plan, "kohya").items()})
            s, p = plan.settings, plan.prediction
            if s is None or p is None:  # a plan that fits has both
                continue
            rows.append(f"| {family} | {tier} | {s.resolution[0]} | {s.train_batch_size} x "
                        f"{s.gradient_accumulation_steps} | {'on' if s.gradient_checkpointing else 'off'} | "
                        f"{s.network_dim} | {s.optimizer_type}"
                        f"{f' + {plan.family.fp8_option}' if s.fp8_base else ''}"
                        f"{f' + blocks_to_swap {s.blocks_to_swap}' if s.blocks_to_swap else ''} | "
                        f"{p.peak_bytes / GIB:.2f} |")
    files["README.md"] = "\n".join([
        "# Templates (generated: `python -m autotune.planning.templates`; do not edit by hand)",
        "",
        "Planned by lora-autotune for a card of each size (generic Ampere rates, bf16), goal character, priority",
        "balanced, 20 images x 10 repeats. Copy a folder, set `pretrained_model_name_or_path` in config.toml and",
        "`image_dir` in dataset.toml, then run `accelerate launch SCRIPT --config_file config.toml` from that",
        "folder, SCRIPT being the one each config.toml's header names (`train_network.py`, `sdxl_train_network.py`,",
        "`flux_train_network.py` for FLUX.1 and Chroma, `sd3_train_network.py`, `lumina_train_network.py`,",
        "`hunyuan_image_train_network.py`, `anima_train_network.py`). `autotune plan` does the same for your own",
        "GPU and data. The transformer families also need their text-encoder and VAE/AE keys (`clip_l`, `clip_g`,",
        "`t5xxl`, `ae`, `gemma2`, `text_encoder`, `byt5`, `qwen3`, `vae`) pointed at your files; where config.toml",
        "names `t5xxl_fp8_e4m3fn.safetensors`, use an fp8 T5-XXL file (the 16-bit one does not fit while the",
        "text-encoder outputs are cached). The musubi-tuner families (Qwen-Image, FLUX.2, Wan, Z-Image) hold",
        "musubi's files instead: set `image_directory` in dataset.toml, then run `MUSUBI_TUNER=YOUR_CHECKOUT",
        "DIT=... VAE=... TEXT_ENCODER=... bash musubi_train.sh` (Wan: `T5=`) from musubi's venv.",
        "",
        "| family | GB | resolution | micro-batch x accumulation | checkpointing | rank | optimizer "
        "| predicted peak GiB |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ])
    return files


def write_templates(root: Path) -> list[Path]:
    """Write every template under ``root``; a tier's files from an earlier run that no longer apply go."""
    files = template_files()
    written = []
    for family in FAMILIES:
        for tier in FAMILY_TIERS[family]:
            for name in ("config.toml", "dataset.toml", "musubi_train.sh", "DOES_NOT_FIT.txt"):
                old = root / family / f"{tier}gb" / name
                if f"{family}/{tier}gb/{name}" not in files and old.is_file():
                    old.unlink()
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, text)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=TEMPLATE_DIR, help="folder to write (default: templates/)")
    args = parser.parse_args(argv)
    paths = write_templates(args.out)
    print(f"wrote {len(paths)} files under {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
