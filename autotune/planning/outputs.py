"""What a plan produces besides config.toml's keys: the dataset.toml values and the launch command line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autotune.planning.dataset import DatasetSummary
from autotune.planning.resolution import bucket_rules
from sd_scripts_compat.facts.families import FamilySpec
from sd_scripts_compat.facts.settings import TrainSettings
from sd_scripts_compat.facts.settings_space import dataset_values


def dataset_config(settings: TrainSettings, dataset: DatasetSummary, family: FamilySpec) -> dict[str, Any]:
    """kohya's dataset.toml: [general] + one [[datasets]] with a [[datasets.subsets]] per N_name folder."""
    subsets = []
    for sub in dataset.subsets:
        entry: dict[str, Any] = {"image_dir": sub.image_dir, "num_repeats": sub.num_repeats}
        if sub.class_tokens:
            entry["class_tokens"] = sub.class_tokens
        subsets.append(entry)
    cached_text = settings.cache_text_encoder_outputs
    general: dict[str, Any] = {"caption_extension": dataset.caption_extension, "shuffle_caption": not cached_text,
                               "keep_tokens": 0 if cached_text else 1}
    step, min_bucket = bucket_rules(family, settings.resolution[0])
    values = dataset_values(settings)  # the one mapping of settings to dataset.toml
    block = {
        "resolution": values["resolution"],
        "batch_size": values["batch_size"],
        "enable_bucket": True,
        "min_bucket_reso": min_bucket,
        "max_bucket_reso": values.get("max_bucket_reso"),
        "bucket_reso_steps": step,
        "bucket_no_upscale": True,
        "subsets": subsets,
    }
    return {"general": general, "datasets": [block]}


def launch_command(family: FamilySpec, devices: int, precision: str, output_dir: str | None,
                   cpu_threads: int = 1) -> tuple[str, ...]:
    """The sd-scripts command line for this plan (our engine takes the same --config_file); for a family
    musubi-tuner trains, the script that caches and trains (``planning.musubi_writer``). ``cpu_threads``: accelerate
    turns it into OMP_NUM_THREADS, so 1 only where a GPU runs the step."""
    folder = Path(output_dir).expanduser().resolve() if output_dir is not None else None
    if family.trains_with.caches_apart:
        return ("bash", "musubi_train.sh" if folder is None else str(folder / "musubi_train.sh"))
    config = "config.toml" if folder is None else str(folder / "config.toml")
    cmd = ["accelerate", "launch", "--num_processes", str(devices)]
    if devices > 1:
        cmd.append("--multi_gpu")
    if precision in ("fp16", "bf16"):
        cmd += ["--mixed_precision", precision]
    cmd += ["--num_cpu_threads_per_process", str(cpu_threads), family.kohya_script, "--config_file", config]
    return tuple(cmd)
