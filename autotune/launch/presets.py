"""Presets in and out: a kohya_ss GUI preset (its ``presets/lora/*.json``) or a sd-scripts config.toml as the options
of ``autotune plan`` / ``run`` (the web page's form), and a plan as a kohya_ss GUI preset.

Every key of the file is accounted for, never dropped silently: ``applied`` (it became one of our options, with the
value sd-scripts gets), ``planned`` (the planner decides it for the card: precision, checkpointing, caching,
attention, buckets, workers ...; the file's value is shown beside the plan's) or ``ignored`` (no option of ours sets
it, with the reason). What the GUI passes to sd-scripts for its fields is read from kohya_ss' ``lora_gui.py``
(``train_model``: LoRA_type to network_module and network_args, ``epoch`` to the run's length, ``lr_warmup`` as a
percentage, empty and 0 values left out) and written here as rules: the GUI's code is not ours to ship.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# the GUI's LoRA_type -> our --network (LyCORIS algorithms through lycoris.kohya; FLUX.1's LoRA is the family's)
GUI_NETWORKS = {"Standard": "lora", "Flux1": "lora", "LoCon": "locon", "LyCORIS/LoCon": "locon",
                "LyCORIS/LoHa": "loha", "LyCORIS/LoKr": "lokr"}
# the network_args the GUI passes for each LyCORIS type (lora_gui.train_model), with lycoris-lora's defaults: a value
# equal to the default is left out (the same network either way); conv_dim / conv_alpha always go
_LYCORIS_COMMON = ("preset", "conv_dim", "conv_alpha", "use_tucker", "rank_dropout", "bypass_mode", "dora_wd",
                   "module_dropout", "use_scalar", "rank_dropout_scale", "train_norm")
GUI_LYCORIS_ARGS = {"locon": _LYCORIS_COMMON, "loha": _LYCORIS_COMMON,
                    "lokr": (*_LYCORIS_COMMON, "factor", "use_cp", "decompose_both")}
LYCORIS_DEFAULTS: dict[str, Any] = {"preset": "full", "use_tucker": False, "rank_dropout": 0, "bypass_mode": False,
                                    "dora_wd": False, "module_dropout": 0, "use_scalar": False,
                                    "rank_dropout_scale": False, "train_norm": False, "use_cp": False,
                                    "decompose_both": False, "factor": -1}
NETWORK_FIELDS = (*GUI_LYCORIS_ARGS["lokr"], "LyCORIS_preset")  # the GUI's fields of a LyCORIS network

# sd-scripts keys -> our option (body key); the settings of user_settings are their own keys
KOHYA_OPTIONS = {"network_dim": "rank", "network_alpha": "alpha", "optimizer_type": "optimizer",
                 "learning_rate": "lr", "train_batch_size": "batch", "gradient_accumulation_steps": "accum",
                 "max_train_steps": "steps", "max_train_epochs": "epochs", "output_name": "output_name",
                 "max_data_loader_n_workers": "workers"}
# what the plan decides for the card (the file's value is shown, the plan's is trained)
PLANNED = ("mixed_precision", "gradient_checkpointing", "cache_latents", "cache_latents_to_disk",
           "cache_text_encoder_outputs", "cache_text_encoder_outputs_to_disk", "xformers", "sdpa", "mem_eff_attn",
           "fp8_base", "fp8_base_unet", "full_fp16", "full_bf16", "persistent_data_loader_workers", "enable_bucket",
           "min_bucket_reso", "max_bucket_reso", "bucket_reso_steps", "bucket_no_upscale", "save_precision",
           "save_model_as", "vae_batch_size", "blocks_to_swap", "text_encoder_lr", "unet_lr", "optimizer_args",
           "network_train_unet_only", "output_dir", "logging_dir", "log_with", "save_state", "no_half_vae",
           "network_module", "network_args", "lowvram", "highvram", "cpu_offload_checkpointing",
           "timestep_sampling", "model_prediction_type", "discrete_flow_shift", "guidance_scale",
           "apply_t5_attn_mask", "t5xxl_max_token_length", "max_token_length", "caption_extension",
           "dataset_config", "pretrained_model_name_or_path", "train_data_dir", "torch_compile", "dynamo_backend")
# the GUI's own fields that say nothing to sd-scripts, or are read with another key above
GUI_ONLY = ("LoRA_type", "epoch", "lr_warmup", "max_resolution", "optimizer", "sdxl", "v2", "v_parameterization",
            "flux1_checkbox", "sd3_checkbox", "num_cpu_threads_per_process", "use_wandb", "noise_offset_type",
            "model_list", "stop_text_encoder_training", "num_processes", "num_machines", "gpu_ids",
            "main_process_port", "mixed_precision_accelerate", "dynamo_mode", "dynamo_use_fullgraph",
            "dynamo_use_dynamic", "extra_accelerate_launch_args", "multi_gpu", "LyCORIS_preset", "save_as_bool",
            "unit")
# the GUI's fields it turns into something else before sd-scripts sees them, which we cannot take as they are
GUI_IGNORED = {"sample_prompts": "the GUI's prompt text (it writes a file of it): write it to a file and give "
                                 "sample_prompts FILE",
               "additional_parameters": "extra command-line text is not read: give each setting as an option",
               **dict.fromkeys(("clip_l", "clip_g", "t5xxl", "ae", "vae"), "a file of the machine the preset was "
                               "made on: give the model's files with the model (the page fills them from beside it)")}


@dataclass
class Imported:
    """A preset as our options: ``values`` (the body of POST /api/plan), and every key of the file in one of
    ``applied`` (key -> the option it set), ``planned`` (key -> the file's value) or ``ignored`` (key -> why)."""

    values: dict[str, Any] = field(default_factory=dict)
    applied: dict[str, str] = field(default_factory=dict)
    planned: dict[str, Any] = field(default_factory=dict)
    ignored: dict[str, str] = field(default_factory=dict)
    unset: list[str] = field(default_factory=list)  # keys left empty ("", 0, False): nothing set

    def apply(self, key: str, option: str, value: Any) -> None:
        self.values[option] = value
        self.applied[key] = option

    def as_dict(self) -> dict[str, Any]:
        return {"values": self.values, "applied": self.applied, "planned": self.planned, "ignored": self.ignored,
                "unset": self.unset}


def _empty(value: Any) -> bool:
    """The GUI leaves these out of what it passes (``""``, 0 or ``"0"``, False, None)."""
    return value is None or value is False or value == "" or (not isinstance(value, bool) and _number(value) == 0)


def _number(value: Any) -> int | float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(number):
        return None
    return int(number) if number.is_integer() else number


def from_kohya_gui(preset: dict[str, Any]) -> Imported:
    """A kohya_ss GUI LoRA preset as our options, every key accounted for."""
    out = Imported()
    _gui_network(preset, out)
    _gui_length(preset, out)
    _gui_warmup(preset, out)
    side = _square_side(preset.get("max_resolution"))
    if side is not None:
        out.apply("max_resolution", "resolution", side)
    elif not _empty(preset.get("max_resolution")):
        out.ignored["max_resolution"] = (f"{preset['max_resolution']}: plans train square buckets of one area; "
                                         "give one side")
    optimizer = _optimizer(preset.get("optimizer"))
    if optimizer:
        out.apply("optimizer", "optimizer", optimizer)
    elif not _empty(preset.get("optimizer")):
        out.ignored["optimizer"] = f"{preset['optimizer']}: not an optimizer lora-autotune's engine trains"
    if preset.get("noise_offset_type", "Original") != "Original":
        for key in ("noise_offset", "multires_noise_discount", "multires_noise_iterations"):
            if not _empty(preset.get(key)):
                out.ignored[key] = f"noise_offset_type {preset['noise_offset_type']}: only the original offset"
    if _empty(preset.get("lr_scheduler_num_cycles")) and _number(preset.get("epoch")):  # the GUI's fallback
        out.apply("lr_scheduler_num_cycles", "lr_scheduler_num_cycles", _number(preset["epoch"]))
    for key, why in GUI_IGNORED.items():
        if key in preset:
            if _empty(preset[key]):
                out.unset.append(key)
            else:
                out.ignored[key] = why
    done = set(out.applied) | set(out.ignored) | set(out.planned) | set(out.unset)
    _kohya_keys(preset, out, skip=set(GUI_ONLY) | done | set(GUI_IGNORED))
    for key in GUI_ONLY:
        if key in preset and key not in out.applied and key not in out.ignored and key not in out.planned:
            if _empty(preset[key]):
                out.unset.append(key)
            else:
                out.planned[key] = preset[key]
    return out


def from_sd_scripts(config: dict[str, Any]) -> Imported:
    """A sd-scripts config.toml (flat, or sectioned as lora-scripts writes it) as our options."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        flat.update(value if isinstance(value, dict) else {key: value})
    out = Imported()
    module, args = flat.get("network_module"), flat.get("network_args") or []
    algo = next((a.split("=", 1)[1] for a in args if isinstance(a, str) and a.startswith("algo=")), None)
    if module == "lycoris.kohya" and algo in ("locon", "loha", "lokr"):
        out.apply("network_module", "network", algo)
        extra = [a for a in args if isinstance(a, str) and not a.startswith("algo=")]
        if extra:
            out.apply("network_args", "network_arg", extra)
    elif module is not None and str(module).startswith("networks.lora"):
        out.applied["network_module"] = "network"
        out.values["network"] = "lora"
        if args:
            out.apply("network_args", "network_arg", [str(a) for a in args])
    elif module is not None:
        out.ignored["network_module"] = f"{module}: lora-autotune trains networks.lora and lycoris.kohya's " \
                                        "locon, loha, lokr"
    side = _square_side(flat.get("resolution"))
    if side is not None:
        out.apply("resolution", "resolution", side)
    _kohya_keys(flat, out, skip={"network_module", "network_args", "resolution"})
    return out


def _kohya_keys(source: dict[str, Any], out: Imported, skip: set[str]) -> None:
    """sd-scripts' own keys: our options, the settings (launch.user_settings), the planned ones, the rest."""
    from autotune.launch.user_settings import SETTINGS
    from sd_scripts_compat.facts.kohya_args import load_arg_specs

    settings, specs = {key for keys in SETTINGS.values() for key in keys}, load_arg_specs()
    for key, value in source.items():
        if key in skip:
            continue
        if _empty(value) and key != "lr_warmup_steps":
            out.unset.append(key)
            continue
        if key in KOHYA_OPTIONS:
            number = _number(value) if key not in ("optimizer_type", "output_name") else value
            if key == "optimizer_type":
                number = _optimizer(value)
            if number is None:
                out.ignored[key] = f"{value!r}: not a value lora-autotune takes"
            else:
                out.apply(key, KOHYA_OPTIONS[key], number)
        elif key in settings:
            out.apply(key, key, _setting_value(key, value))
        elif key in PLANNED:
            out.planned[key] = value
        elif key in specs and _same(value, specs[key].default):
            out.applied[key] = "sd-scripts' default"  # what the plan leaves it at: the same
        else:
            out.ignored[key] = "no option of lora-autotune sets it (the plan leaves it at sd-scripts' default)"


def _same(value: Any, default: Any) -> bool:
    number, other = _number(value), _number(default)
    return value == default or (number is not None and number == other and not isinstance(value, bool))


def _setting_value(key: str, value: Any) -> Any:
    if key in ("lr_scheduler", "sample_sampler", "sample_prompts"):
        return str(value)
    if key == "sample_at_first":
        return bool(value)
    number = _number(value)
    return value if number is None else number


def _gui_network(preset: dict[str, Any], out: Imported) -> None:
    """LoRA_type and its network_args, as the GUI builds them (a value equal to lycoris-lora's default left out)."""
    kind = preset.get("LoRA_type", "Standard")
    network = GUI_NETWORKS.get(kind)
    if network is None:
        out.ignored["LoRA_type"] = f"{kind}: lora-autotune trains Standard / Flux1 LoRA and LyCORIS LoCon, LoHa, LoKr"
        return
    out.apply("LoRA_type", "network", network)
    from sd_scripts_compat.config.network_args import LYCORIS_KEYS

    passed = GUI_LYCORIS_ARGS.get(network, ())
    fields = {**preset, "preset": preset.get("LyCORIS_preset", "full")}
    differ = [key for key in passed if key in fields
              and (key in ("conv_dim", "conv_alpha") or fields[key] != LYCORIS_DEFAULTS[key])]
    args = [f"{key}={fields[key]}" for key in differ if key in LYCORIS_KEYS]
    for key in differ:
        if key not in LYCORIS_KEYS:  # the GUI passes it; lycoris-lora's kohya entry point would ignore it
            out.ignored[key] = f"{key}={fields[key]}: lycoris-lora's kohya networks do not read it (ignored there)"
    if args:
        out.values["network_arg"] = args
    for key in NETWORK_FIELDS:
        if key not in preset:
            continue
        name = "preset" if key == "LyCORIS_preset" else key
        if key in out.ignored:
            continue
        if name in passed:
            out.applied[key] = "network_arg" if any(a.startswith(f"{name}=") for a in args) else "network"
        elif not _empty(preset[key]):
            out.ignored[key] = f"the GUI passes it with another LoRA_type, not {kind}"


def _gui_length(preset: dict[str, Any], out: Imported) -> None:
    """The GUI trains max_train_steps when it is set, else its epochs over the dataset (our --epochs)."""
    steps, epochs = _number(preset.get("max_train_steps")), _number(preset.get("max_train_epochs"))
    if steps:
        out.apply("max_train_steps", "steps", steps)
    elif epochs:
        out.apply("max_train_epochs", "epochs", epochs)
    elif _number(preset.get("epoch")):
        out.apply("epoch", "epochs", _number(preset["epoch"]))
    for key in ("max_train_steps", "max_train_epochs", "epoch"):
        if key in preset and key not in out.applied:
            if _empty(preset[key]):
                out.unset.append(key)
            else:
                out.planned[key] = preset[key]


def _gui_warmup(preset: dict[str, Any], out: Imported) -> None:
    """The GUI's rule (common_gui.resolve_lr_warmup_steps): an absolute lr_warmup_steps wins, else lr_warmup
    percent / 100 (sd-scripts reads a value below 1 as that share of the steps), else 0."""
    steps, percent = _number(preset.get("lr_warmup_steps")) or 0, _number(preset.get("lr_warmup")) or 0
    value = int(steps) if steps > 0 else percent / 100 if percent else 0
    out.apply("lr_warmup_steps" if steps > 0 else "lr_warmup", "lr_warmup_steps", value)
    if steps <= 0 and "lr_warmup_steps" in preset:
        out.applied["lr_warmup_steps"] = "lr_warmup_steps"


def _square_side(resolution: Any) -> int | None:
    parts = [p.strip() for p in str(resolution or "").split(",")]
    sides = [_number(p) for p in parts if p]
    if not sides or any(not isinstance(s, int) for s in sides) or len(set(sides)) != 1:
        return None
    return int(sides[0])  # type: ignore[arg-type]


def _optimizer(name: Any) -> str | None:
    """The optimizer by its canonical name (``arg_types.optimizer_name``), or None for one the engine lacks."""
    from autotune.launch.arg_types import optimizer_name
    from sd_scripts_compat.facts.optimizers import optimizer_names

    canonical = optimizer_name(str(name or ""))
    return canonical if canonical in optimizer_names() else None


# our config keys -> the kohya_ss GUI's field of the same meaning, where the names differ
GUI_FIELDS = {"optimizer_type": "optimizer", "max_train_epochs": "epoch", "resolution": "max_resolution"}
GUI_ATTENTION = (("xformers", "xformers"), ("sdpa", "sdpa"))  # the GUI's one "xformers" field: none | sdpa | xformers


def to_kohya_gui(config: dict[str, Any], family_is: dict[str, bool]) -> dict[str, Any]:
    """A plan's config values as a kohya_ss GUI LoRA preset (the reverse of ``from_kohya_gui``): LoRA_type and its
    network fields from network_module / network_args, the run's length as ``epoch`` or ``max_train_steps``, the
    warm-up as absolute ``lr_warmup_steps``, the attention field, lists as the GUI's space-separated text, the
    family's checkbox (``family_is``: sdxl, sd3_checkbox, flux1_checkbox); every other key as it is."""
    out: dict[str, Any] = {"LoRA_type": "Standard", **family_is}
    args = [str(a) for a in config.get("network_args") or []]
    named = dict(a.split("=", 1) for a in args if "=" in a)
    module = str(config.get("network_module", ""))
    if module == "lycoris.kohya":
        out["LoRA_type"] = {"locon": "LyCORIS/LoCon", "loha": "LyCORIS/LoHa", "lokr": "LyCORIS/LoKr"}.get(
            named.pop("algo", ""), "LyCORIS/LoCon")
        out.update({key: _number(value) if _number(value) is not None else value for key, value in named.items()})
    elif module.endswith("_flux"):
        out["LoRA_type"] = "Flux1"
    out["xformers"] = next((gui for key, gui in GUI_ATTENTION if config.get(key)), "none")
    for key, value in config.items():
        if key in ("network_module", "network_args", "xformers", "sdpa"):
            continue
        if key == "resolution":
            value = str(value)
        elif isinstance(value, list):
            value = " ".join(str(v) for v in value) if key != "text_encoder_lr" else value[0]
        out[GUI_FIELDS.get(key, key)] = value
    warmup = config.get("lr_warmup_steps")
    if isinstance(warmup, float) and 0 < warmup < 1:  # a share of the steps: the GUI's percent field
        out.update(lr_warmup=round(warmup * 100, 6), lr_warmup_steps=0)
    if "max_train_steps" in config:
        out["epoch"] = 1  # the GUI trains max_train_steps when it is set
    return out
