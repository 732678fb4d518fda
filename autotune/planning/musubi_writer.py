"""Write a plan for a family kohya trains in musubi-tuner (Qwen-Image, FLUX.2, Wan, Z-Image) as the files
musubi-tuner runs unchanged: its ``dataset.toml`` (``docs/dataset_config.md``: ``[general]`` and one
``[[datasets]]`` per image folder, each with its own cache folder inside the output folder), a ``config.toml``
for the training script's ``--config_file`` (musubi flattens it into its argparse namespace, as sd-scripts does),
and ``musubi_train.sh``: the latent caching, text-encoder caching and training commands in order.

The plan is made in kohya's names (one settings shape from planner to engine); here they become musubi's: a key
musubi's training script has keeps its name, ``cpu_offload_checkpointing`` becomes
``gradient_checkpointing_cpu_offload``, the dataset keys move into the dataset TOML, the caching keys become the
two caching steps, and a key musubi has no option for is left out. Every option of every command is checked
against the script's own option table (``sd_scripts_compat.facts.musubi_args``) before anything is written.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.planning.planner import Plan
from autotune.planning.profiles import plan_profile
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import FamilySpec
from sd_scripts_compat.facts.kohya_toml import encode_value, loads
from sd_scripts_compat.facts.musubi_args import MUSUBI_NAMES, check_musubi_value, musubi_argv, musubi_options

MUSUBI_SCRIPT = "musubi_train.sh"
CACHE_FOLDER = "musubi_cache"  # inside the output folder: caching never writes into the user's dataset
DATASET_KEYS = frozenset({"dataset_config", "resolution", "enable_bucket", "min_bucket_reso", "max_bucket_reso",
                          "bucket_reso_steps", "bucket_no_upscale", "train_batch_size", "caption_extension"})
CACHING_KEYS = frozenset({"cache_latents", "cache_latents_to_disk", "cache_text_encoder_outputs",
                          "cache_text_encoder_outputs_to_disk"})
# musubi's built-in optimizer names (trainer_base.get_optimizer lower-cases them); others as a dotted path
OPTIMIZERS = {"AdamW8bit": "adamw8bit", "AdamW": "adamw", "Adafactor": "adafactor", "Prodigy": "prodigyopt.Prodigy"}
MODEL_VARIABLES = {"dit": "DIT", "vae": "VAE", "text_encoder": "TEXT_ENCODER", "t5": "T5",
                   "dit_high_noise": "DIT_HIGH_NOISE"}


@dataclass(frozen=True)
class MusubiFiles:
    dataset: str  # dataset.toml text
    config: str  # config.toml text (the training script's --config_file)
    script: str  # musubi_train.sh text
    commands: tuple[tuple[str, ...], ...]  # cache latents, cache text-encoder outputs, train (argv, checked)


def is_musubi_plan(plan: Plan) -> bool:
    return plan.family.trains_with.caches_apart


def training_options(plan: Plan, family: FamilySpec) -> dict[str, Any]:
    """The plan's kohya values as musubi's training options (checked against its table)."""
    script = family.script
    table = musubi_options(script)
    out: dict[str, Any] = {}
    for key, value in plan.kohya_values().items():
        name = MUSUBI_NAMES.get(key, key)
        if key in DATASET_KEYS or key in CACHING_KEYS or name not in table or key in MODEL_VARIABLES:
            continue
        out[name] = OPTIMIZERS.get(value, value) if name == "optimizer_type" else value
    if out.get("optimizer_type") and out["optimizer_type"] not in OPTIMIZERS.values():
        raise UserError(f"optimizer {out['optimizer_type']}: musubi-tuner's planned names are "
                        f"{', '.join(OPTIMIZERS)}; choose one with --optimizer")
    if out.get("fp8_base") and (family.musubi or {}).get("fp8_scaled"):
        out["fp8_scaled"] = True  # musubi quantizes block-wise from the bf16 file; its docs' settings use it
    out["dataset_config"] = "dataset.toml"
    for name, value in out.items():
        check_musubi_value(script, name, value)
    return out


def render_musubi_dataset(plan: Plan) -> str:
    """musubi's dataset TOML: [general] from the plan's bucket rules, one [[datasets]] per image folder."""
    general, datasets = plan.dataset_config["general"], plan.dataset_config["datasets"]
    first = datasets[0]
    width, height = first["resolution"]
    values: dict[str, Any] = {
        "resolution": [width, height], "caption_extension": general.get("caption_extension", ".txt"),
        "batch_size": first.get("batch_size", 1), "enable_bucket": bool(first.get("enable_bucket", True)),
        "bucket_no_upscale": bool(first.get("bucket_no_upscale", False))}
    lines = [f"# musubi-tuner dataset config for {plan.family.name}, written by autotune plan",
             "# caches live in the output folder, one per image folder, so caching never writes into the dataset",
             "", "[general]"]
    lines += [f"{key} = {encode_value(value)}" for key, value in values.items()]
    entries = []
    for dataset in datasets:
        for index, subset in enumerate(dataset["subsets"]):
            entry = {"image_directory": subset["image_dir"], "cache_directory": f"{CACHE_FOLDER}/{index:02d}",
                     "num_repeats": subset.get("num_repeats", 1)}
            if plan.settings is not None and plan.settings.frames > 1:  # clips: the first N frames of each video
                entry = {"video_directory": entry.pop("image_directory"), **entry,
                         "target_frames": [plan.settings.frames], "frame_extraction": "head"}
            entries.append(entry)
            lines += ["", "[[datasets]]"] + [f"{key} = {encode_value(value)}" for key, value in entry.items()]
    text = "\n".join(lines) + "\n"
    if loads(text) != {"general": values, "datasets": entries}:
        raise AssertionError("the musubi dataset TOML does not parse back to the planned values")
    return text


def musubi_commands(plan: Plan) -> tuple[tuple[str, ...], ...]:
    """The caching and training commands (paths relative to the musubi-tuner checkout's ``src/musubi_tuner``;
    model files as the shell variables ``$DIT`` (and Wan 2.2's ``$DIT_HIGH_NOISE``), ``$VAE`` and
    ``$TEXT_ENCODER`` / ``$T5``), each option checked
    against its script's table. The text encoder is cached in fp8 where the plan chose its fp8 flag."""
    family = plan.family
    facts = family.musubi or {}
    models = {name: f"${variable}" for name, variable in MODEL_VARIABLES.items()}
    version = dict(zip(facts.get("version_args", [])[::2], facts.get("version_args", [])[1::2]))
    version = {k.removeprefix("--"): v for k, v in version.items()}

    def step(script: str, options: dict[str, Any]) -> tuple[str, ...]:
        name = script.removesuffix(".py")
        table = musubi_options(name)
        options = {**options, **{k: v for k, v in version.items() if k in table}}
        words = []
        for key, value in options.items():
            if isinstance(value, str) and value.startswith("$"):
                check_musubi_value(name, key, "file")  # a path option; the value comes from the environment
                words += [f"--{key}", value]
            else:
                words += musubi_argv(name, {key: value})
        return (f"src/musubi_tuner/{script}", *words)

    te_option = facts["text_encoder_option"]
    # one sample at a time: the memory model's latent-caching peak (a batch multiplies the VAE's transient)
    latents = step(facts["cache_latents"], {"dataset_config": "dataset.toml", "vae": models["vae"], "batch_size": 1})
    te_options: dict[str, Any] = {"dataset_config": "dataset.toml", te_option: models[te_option], "batch_size": 16}
    if facts.get("text_encoder_fp8") and plan.kohya_values().get(facts["text_encoder_fp8"]):
        te_options[facts["text_encoder_fp8"]] = True
    if plan.kohya_values().get("text_encoder_cpu"):  # the planner's choice where it does not fit the card
        te_options["device"] = "cpu"
    text = step(facts["cache_text_encoder_outputs"], te_options)
    # the VAE too: musubi decodes sample images with it (its docs list it for training)
    dits = {"dit": models["dit"]}
    two = plan_profile(plan.family).both_experts
    if two and plan.settings is not None and plan.settings.high_noise_expert:  # Wan 2.2: the second expert's file
        dits[two.file_key] = models[two.file_key]
    train = step(family.kohya_script, {"config_file": "config.toml", **dits, "vae": models["vae"]})
    precision = plan.kohya_values().get("mixed_precision", "bf16")
    return (("python", *latents), ("python", *text),
            ("accelerate", "launch", "--num_cpu_threads_per_process", str(plan.cpu_threads), "--mixed_precision",
             precision, *train))


def render_musubi_config(plan: Plan) -> str:
    family = plan.family
    options = training_options(plan, family)
    reasons = {MUSUBI_NAMES.get(c.key, c.key): c.reason for c in plan.choices if c.kohya}
    lines = [f"# musubi-tuner {family.kohya_script} --config_file, written by autotune plan for {plan.family.name}",
             "# model files are given on the command line (musubi_train.sh)"]
    for name, value in options.items():
        if name in reasons:
            lines.append("# " + reasons[name].replace("\n", " "))
        lines.append(f"{name} = {encode_value(value)}")
    text = "\n".join(lines) + "\n"
    if loads(text) != {k: (list(v) if isinstance(v, tuple) else v) for k, v in options.items()}:
        raise AssertionError("the musubi config does not parse back to the planned values")
    return text


def model_defaults(plan: Plan) -> dict[str, str]:
    """The plan's own model paths for the script's variables, where they are files: the DiT it was planned for,
    the VAE and text encoder given (the profile's placeholder paths are not defaults)."""
    values = {"dit": plan.model, **plan.kohya_values()}
    return {variable: str(Path(values[name]).resolve()) for name, variable in MODEL_VARIABLES.items()
            if values.get(name) and Path(str(values[name])).is_file()}


def render_musubi_script(plan: Plan, commands: tuple[tuple[str, ...], ...]) -> str:
    """A bash script that runs the three steps from the musubi-tuner checkout named by ``MUSUBI_TUNER``, the
    model files from the environment (defaulting to the plan's own paths)."""
    defaults = model_defaults(plan)
    quoted = [" ".join(f'"{word}"' if word.startswith("$") else shlex.quote(word) for word in command)
              for command in commands]
    variables = sorted({word[1:] for command in commands for word in command if word.startswith("$")})
    lines = ["#!/usr/bin/env bash", f"# {plan.family.name}: cache latents, cache text-encoder outputs, train "
             "(musubi-tuner; written by autotune plan)", "set -euo pipefail",
             'PLAN_DIR="$(cd "$(dirname "$0")" && pwd)"',
             ': "${MUSUBI_TUNER:?set MUSUBI_TUNER to your musubi-tuner checkout}"']
    for name in variables:
        if name in defaults:
            lines.append(f': "${{{name}:={shlex.quote(defaults[name])}}}"')
        else:
            lines.append(f': "${{{name}:?set {name} to the model file}}"')
    lines += ['cd "$PLAN_DIR"', 'export PYTHONPATH="$MUSUBI_TUNER/src${PYTHONPATH:+:$PYTHONPATH}"']
    for command in quoted:
        lines.append(command.replace("src/musubi_tuner/", '"$MUSUBI_TUNER"/src/musubi_tuner/', 1))
    return "\n".join(lines) + "\n"


def render_musubi_files(plan: Plan) -> MusubiFiles:
    """Every text of a fitting musubi plan, rendered and checked (nothing written)."""
    if not plan.fits:
        raise UserError(plan.message)
    commands = musubi_commands(plan)
    return MusubiFiles(dataset=render_musubi_dataset(plan), config=render_musubi_config(plan),
                       script=render_musubi_script(plan, commands), commands=commands)
