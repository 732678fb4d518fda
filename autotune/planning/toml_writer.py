"""Write a plan as ``config.toml`` + ``dataset.toml`` that sd-scripts (and lora-scripts) accept unchanged.

sd-scripts reads ``--config_file`` with the ``toml`` package (TOML 0.5: no mixed-type arrays), flattens
sections one level and puts values into its argparse namespace without conversion, so the file must
hold kohya's names with kohya's own value types: ``resolution = "1024,1024"`` (a string), list options
(``network_args``, ``optimizer_args``, ``text_encoder_lr``) as homogeneous arrays. ``dataset.toml``
follows kohya's ``[general]`` / ``[[datasets]]`` / ``[[datasets.subsets]]`` schema.

The ``toml`` package cannot write comments, and every tuned key carries one (its reason), so lines are
laid out here and each value is encoded by ``toml.dumps``; the finished text is parsed back and compared
with the values before anything is written.

Formats: ``kohya`` is flat (comment headings only); ``lora-scripts`` puts the same keys into the sections
lora-scripts' templates use (``[model_arguments]``, ``[dataset_arguments]``, ...), which sd-scripts
flattens away again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from autotune.layout import CONFIG, DATASET_CONFIG, PLAN_FILE
from autotune.planning.planner import Plan
from autotune.planning.request import GIB
from sd_scripts_compat.facts.atomic import write_text_atomic
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.kohya_toml import encode_value, flat_values, loads

FORMATS = ("kohya", "lora-scripts")

# Section of each key in lora-scripts' layout (config/lora.toml of Akegarasu/lora-scripts); the kohya
# format shows the same groups as comment headings. Keys not listed go to [others], as there.
SECTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("model_arguments", ("pretrained_model_name_or_path", "v2", "v_parameterization", "vae", "no_half_vae",
                         "clip_l", "t5xxl", "ae")),
    ("dataset_arguments", ("dataset_config", "train_data_dir", "reg_data_dir", "resolution", "enable_bucket",
                           "min_bucket_reso", "max_bucket_reso", "bucket_reso_steps", "bucket_no_upscale",
                           "cache_latents", "cache_latents_to_disk", "cache_text_encoder_outputs",
                           "cache_text_encoder_outputs_to_disk", "caption_extension", "shuffle_caption",
                           "keep_tokens", "max_data_loader_n_workers", "persistent_data_loader_workers")),
    ("additional_network_arguments", ("network_module", "network_dim", "network_alpha", "network_args",
                                      "network_train_unet_only", "network_train_text_encoder_only",
                                      "network_weights")),
    ("optimizer_arguments", ("optimizer_type", "optimizer_args", "learning_rate", "unet_lr", "text_encoder_lr",
                             "lr_scheduler", "lr_warmup_steps", "lr_scheduler_num_cycles", "max_grad_norm")),
    ("training_arguments", ("train_batch_size", "gradient_accumulation_steps", "gradient_checkpointing",
                            "mixed_precision", "fp8_base", "full_fp16", "full_bf16", "sdpa", "xformers",
                            "torch_compile", "dynamo_backend",
                            "max_train_epochs", "max_train_steps", "seed", "clip_skip", "noise_offset",
                            "min_snr_gamma", "blocks_to_swap", "timestep_sampling", "model_prediction_type",
                            "guidance_scale", "discrete_flow_shift")),
    ("saving_arguments", ("output_dir", "output_name", "save_model_as", "save_precision", "save_every_n_epochs",
                          "save_every_n_steps", "save_last_n_epochs", "save_last_n_steps", "save_state")),
    ("sample_prompt_arguments", ("sample_prompts", "sample_every_n_steps", "sample_every_n_epochs",
                                 "sample_sampler", "sample_at_first")),
    ("logging_arguments", ("logging_dir", "log_with", "log_prefix")),
)
OTHERS_SECTION = "others"


def section_of(key: str) -> str:
    for name, keys in SECTIONS:
        if key in keys:
            return name
    return OTHERS_SECTION


def _comment(text: str) -> str:
    return "# " + " ".join(text.split())


def human_seconds(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    if minutes:
        return f"{minutes} min {secs:02d} s"
    return f"{secs} s"


def header_lines(plan: Plan, what: str) -> list[str]:
    """The header every written file starts with: tool, probe, prediction."""
    p = plan.prediction
    script = next((w for w in plan.launch_command if w.endswith(".py")), "train_network.py")
    lines = [
        f"{what} written by lora-autotune {plan.version} (autotune plan) for sd-scripts {script} "
        "or lora-autotune's engine",
        f"model: {plan.model} (family {plan.family.name}); goal {plan.goal}; priority {plan.priority}",
        f"device: {plan.device}" + (f"; {plan.num_processes} processes" if plan.num_processes > 1 else ""),
    ]
    if plan.probe_summary:
        lines.append(f"probe: {plan.probe_summary}")
    if p is not None:
        unit, unit_name = plan.memory_unit
        parts = ", ".join(f"{name} {size / unit:.2f}" for name, size in p.components if size)
        lines += [
            f"predicted peak {plan.memory_noun}: {p.peak_bytes / unit:.2f} {unit_name} of {p.usable_bytes / unit:.2f} "
            f"{unit_name} usable",
            f"predicted memory by part ({unit_name}): {parts}",
            f"predicted speed: {p.it_per_s:.3g} it/s (optimizer steps, kohya's progress bar), "
            f"{p.micro_steps_per_s:.3g} micro-steps/s per device, {p.samples_per_s:.3g} samples/s",
            f"predicted total: {p.optimizer_steps} optimizer steps in {human_seconds(p.total_seconds)}"
            + (f" (with {human_seconds(p.compile_seconds)} compiling)" if p.compile_seconds else ""),
        ]
        if p.ram_peak_bytes:
            each = f"{p.loading_processes}, each " if p.ram_processes > 1 else ""
            lines.append(f"predicted peak host RAM: {p.ram_peak_bytes / GIB:.1f} GiB ({each}"
                         + ", ".join(f"{k} {v / GIB:.1f}" for k, v in p.ram_components if v) + " GiB)")
    if plan.fallbacks:
        lines.append("given up to fit, in order: " + ", ".join(plan.fallbacks))
    if plan.launch_command:
        lines.append("run: " + " ".join(_shell_word(w) for w in plan.launch_command))
    return [_comment(line) for line in lines]


def _shell_word(word: str) -> str:
    safe = all(ch.isalnum() or ch in "-_./:=,+@" for ch in word)
    return word if safe and word else "'" + word.replace("'", "'\\''") + "'"


def render_config(plan: Plan, fmt: str = "kohya") -> str:
    """config.toml text of a fitting plan, in ``fmt`` (kohya | lora-scripts)."""
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt}: choose one of {', '.join(FORMATS)}")
    if not plan.fits:
        raise UserError(plan.message)
    values = plan.kohya_values()
    choices = [c for c in plan.choices if c.kohya]
    order = [name for name, _ in SECTIONS] + [OTHERS_SECTION]
    grouped: dict[str, list] = {name: [] for name in order}
    for choice in choices:
        grouped[section_of(choice.key)].append(choice)
    lines = header_lines(plan, "config.toml")
    for name in order:
        if not grouped[name]:
            continue
        lines.append("")
        lines.append(f"[{name}]" if fmt == "lora-scripts" else _comment(f"--- {name.replace('_', ' ')} ---"))
        for choice in grouped[name]:
            lines.append(_comment(choice.reason))
            lines.append(f"{choice.key} = {encode_value(choice.value)}")
    text = "\n".join(lines) + "\n"
    _check_round_trip(text, values, sectioned=fmt == "lora-scripts")
    return text


def render_dataset(plan: Plan) -> str:
    """dataset.toml text: [general], one [[datasets]] and a [[datasets.subsets]] per image folder."""
    if not plan.fits:
        raise UserError(plan.message)
    config = plan.dataset_config
    lines = header_lines(plan, "dataset.toml")
    lines.append(_comment("kohya dataset config: subset values override [[datasets]], which override [general]"))
    lines += ["", "[general]"]
    for key, value in config["general"].items():
        lines.append(f"{key} = {encode_value(value)}")
    for dataset in config["datasets"]:
        lines += ["", "[[datasets]]"]
        for key, value in dataset.items():
            if key != "subsets":
                lines.append(f"{key} = {encode_value(value)}")
        for subset in dataset["subsets"]:
            lines += ["", "  [[datasets.subsets]]"]
            for key, value in subset.items():
                lines.append(f"  {key} = {encode_value(value)}")
    text = "\n".join(lines) + "\n"
    if loads(text) != config:
        raise AssertionError("dataset.toml does not parse back to the planned values")
    return text


def _check_round_trip(text: str, values: dict[str, Any], sectioned: bool) -> None:
    parsed = flat_values(loads(text)) if sectioned else loads(text)
    expected = {k: (list(v) if isinstance(v, tuple) else v) for k, v in values.items()}
    if parsed != expected:
        raise AssertionError("config.toml does not parse back to the planned values")


def render_plan_files(plan: Plan, fmt: str = "kohya") -> dict[str, str]:
    """The trainer's files of a plan by name, rendered and checked, nothing written: config.toml and dataset.toml
    for sd-scripts (``fmt``: kohya or lora-scripts), or for a family musubi-tuner trains its dataset TOML,
    ``--config_file`` and ``musubi_train.sh`` (its three commands). ``write_plan_files`` and the web app's plan
    page both take them from here."""
    from autotune.planning.musubi_writer import MUSUBI_SCRIPT, is_musubi_plan, render_musubi_files

    if is_musubi_plan(plan):
        musubi = render_musubi_files(plan)
        return {CONFIG: musubi.config, DATASET_CONFIG: musubi.dataset, MUSUBI_SCRIPT: musubi.script}
    return {CONFIG: render_config(plan, fmt), DATASET_CONFIG: render_dataset(plan)}


def write_plan_files(plan: Plan, out_dir: str | os.PathLike[str], fmt: str = "kohya") -> tuple[Path, Path]:
    """Write the trainer's files (``render_plan_files``) and the plan with its reasons and predictions
    (``autotune_plan.json``, which the report compares a run with) into ``out_dir`` (created if missing;
    ``autotune.layout``); returns the configs' paths. ``autotune plan --out``, ``autotune run`` and the wizard
    all write through here.

    Every text is rendered (and checked) before any file is touched; config.toml is written last.
    """
    from autotune.planning.musubi_writer import MUSUBI_SCRIPT

    texts = render_plan_files(plan, fmt)
    plan_text = json.dumps(plan.to_dict(), indent=1, sort_keys=True, default=str)
    out = Path(out_dir).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
        config_path, dataset_path = out / CONFIG, out / DATASET_CONFIG
        write_text_atomic(dataset_path, texts[DATASET_CONFIG])
        write_text_atomic(out / PLAN_FILE, plan_text)
        if MUSUBI_SCRIPT in texts:
            write_text_atomic(out / MUSUBI_SCRIPT, texts[MUSUBI_SCRIPT])
            (out / MUSUBI_SCRIPT).chmod(0o755)
        write_text_atomic(config_path, texts[CONFIG])
    except OSError as error:
        raise UserError(f"--out {out_dir}: cannot write there ({error.strerror or error}); "
                        "choose a writable folder") from None
    return config_path, dataset_path
