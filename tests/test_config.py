"""Training config reading: kohya's option table, TOML + command line, strict checks at the edge."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sd_scripts_compat.config.training_config import (
    ALIASES,
    IMPLEMENTED,
    WRAPPER_KEYS,
    TrainingConfig,
    dataset_group_from_config,
    implemented_fields,
    load_training_config,
)
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.kohya_args import ARGS_TSV, arg_specs, build_argparser, load_arg_specs

DATA = Path(__file__).parent / "data"
REPO = Path(__file__).resolve().parents[1]
REFERENCE_TSV = REPO.parent / "shared" / "reference" / "kohya" / "train_network_args.tsv"  # shared/ sits beside


def write(tmp_path: Path, text: str, name: str = "config.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def load(path: Path, *extra: str, sdxl: bool = False) -> TrainingConfig:
    return load_training_config(["--config_file", str(path), *extra], sdxl=sdxl)


def error_of(path: Path, *extra: str, sdxl: bool = False) -> str:
    with pytest.raises(UserError) as caught:
        load(path, *extra, sdxl=sdxl)
    message = str(caught.value)
    assert "\n" not in message
    return message


# --- the option table -----------------------------------------------------------------------------

@pytest.mark.skipif(not REFERENCE_TSV.is_file(), reason="shared reference checkout not present")
def test_shipped_table_is_the_reference_list():
    assert ARGS_TSV.read_bytes() == REFERENCE_TSV.read_bytes()


def test_table_defaults_and_choices_are_python_values():
    specs = load_arg_specs()
    # sd-scripts' 196 options of train_network / sdxl_train_network + FLUX.1's 19 + those only the SD3, Lumina,
    # HunyuanImage and Anima scripts take (38)
    assert len(specs) == 253
    assert specs["learning_rate"].default == 2e-06 and specs["learning_rate"].kind == "float"
    assert specs["caption_extension"].default == ".caption"
    assert specs["max_train_steps"].default == 1600
    assert specs["xformers"].default is False
    assert specs["lr_scheduler"].default == "constant"
    assert specs["max_token_length"].choices == (None, 150, 225)
    assert specs["mixed_precision"].choices == ("no", "fp16", "bf16")
    assert specs["network_args"].is_list and specs["text_encoder_lr"].kind == "float[nargs=*]"
    assert {name for name, spec in specs.items() if spec.sdxl_only} == {
        "cache_text_encoder_outputs", "cache_text_encoder_outputs_to_disk", "disable_mmap_load_safetensors"}
    assert len(arg_specs(sdxl=True)) == 196 and len(arg_specs(script="flux_train_network")) == 215
    assert arg_specs(script="lumina_train_network")["discrete_flow_shift"].default == 6.0
    assert "nextdit_shift" in arg_specs(script="lumina_train_network")["timestep_sampling"].choices


def test_argparser_has_kohya_names_kinds_and_defaults():
    parser = build_argparser(sdxl=False)
    args = parser.parse_args([])
    assert args.learning_rate == 2e-06 and args.mixed_precision == "no" and args.resolution is None
    args = parser.parse_args(["--resolution", "768,512", "--network_args", "conv_dim=4", "conv_alpha=1",
                              "--optimizer_args", "weight_decay=0.1", "--text_encoder_lr", "1e-5", "2e-5",
                              "--lr_warmup_steps", "0.1", "--max_train_steps", "10", "--xformers"])
    assert args.resolution == "768,512"
    assert args.network_args == ["conv_dim=4", "conv_alpha=1"]
    assert args.text_encoder_lr == [1e-5, 2e-5]
    assert args.lr_warmup_steps == 0.1 and args.max_train_steps == 10 and args.xformers is True
    with pytest.raises(UserError, match="cache_text_encoder_outputs"):
        parser.parse_args(["--cache_text_encoder_outputs"])
    assert build_argparser(sdxl=True).parse_args(["--cache_text_encoder_outputs"]).cache_text_encoder_outputs


def test_implemented_set_matches_the_config_fields():
    specs = load_arg_specs()
    assert IMPLEMENTED <= specs.keys()
    assert set(implemented_fields()) == IMPLEMENTED - ALIASES
    assert not (WRAPPER_KEYS.keys() & specs.keys())


# --- realistic configs ----------------------------------------------------------------------------

def test_flat_kohya_sd15_config():
    cfg = load(DATA / "kohya_flat_sd15.toml")
    assert cfg.pretrained_model_name_or_path == "/models/v1-5-pruned-emaonly.safetensors"
    assert cfg.resolution == (512, 512)
    assert cfg.network_dim == 16 and cfg.network_alpha == 8.0 and isinstance(cfg.network_alpha, float)
    assert cfg.network_args.entries == {"conv_dim": "4", "conv_alpha": "1"} and cfg.network_args.conv_dim == 4
    assert cfg.optimizer_type == "AdamW8bit"
    assert cfg.optimizer_args == {"weight_decay": 0.01, "betas": (0.9, 0.999)}
    assert cfg.unet_lr == 1e-4 and cfg.text_encoder_lr == (5e-5,)
    assert cfg.lr_scheduler == "cosine_with_restarts" and cfg.lr_scheduler_num_cycles == 3
    assert cfg.lr_warmup_steps == 0.05 and cfg.warmup_steps(2000) == 100
    assert cfg.train_batch_size == 2 and cfg.max_train_steps == 2000 and cfg.max_train_epochs == 10
    assert cfg.mixed_precision == "fp16" and cfg.gradient_checkpointing and cfg.xformers
    assert cfg.clip_skip == 2 and cfg.noise_offset == 0.05 and cfg.min_snr_gamma == 5.0
    assert cfg.max_token_length == 225 and cfg.seed == 42
    assert cfg.cache_latents and cfg.cache_latents_to_disk and cfg.save_state
    assert cfg.caption_extension == ".txt" and cfg.keep_tokens == 1 and cfg.caption_dropout_rate == 0.05
    assert cfg.warnings == ()
    assert cfg.raw["resolution"] == "512,512" and cfg.raw["network_args"] == ["conv_dim=4", "conv_alpha=1"]
    assert cfg.config_file == str(DATA / "kohya_flat_sd15.toml")


def test_lora_scripts_sectioned_config_is_accepted():
    cfg = load(DATA / "lora_scripts_lora.toml")
    assert cfg.pretrained_model_name_or_path == "./sd-models/model.ckpt"
    assert cfg.train_data_dir == "./train/aki"
    assert cfg.reg_data_dir is None  # "" means no regularisation images, as in sd-scripts
    assert cfg.raw["reg_data_dir"] == ""
    assert cfg.resolution == (512, 512) and cfg.prior_loss_weight == 1.0
    assert cfg.network_dim == 32 and cfg.network_alpha == 16.0 and cfg.network_args.entries == {}
    assert cfg.unet_lr == 1e-4 and cfg.text_encoder_lr == (1e-5,)
    assert cfg.optimizer_type == "AdamW8bit" and cfg.lr_scheduler == "cosine_with_restarts"
    assert cfg.lr_warmup_steps == 0 and cfg.lr_scheduler_num_cycles == 1
    assert cfg.max_token_length == 225 and cfg.seed == 1337 and cfg.clip_skip == 2
    assert cfg.max_train_epochs == 10 and cfg.mixed_precision == "fp16" and cfg.save_precision == "fp16"
    assert cfg.sample_sampler == "euler_a" and cfg.sample_every_n_epochs == 5
    assert cfg.output_name == "output_name" and cfg.output_dir == "./output" and cfg.log_prefix is None
    assert cfg.cache_latents and cfg.shuffle_caption and cfg.enable_bucket and cfg.xformers
    # only the wrapper key is reported; lowram = false and network_train_text_encoder_only = false change nothing
    assert len(cfg.warnings) == 1
    assert "lr_restart_cycles" in cfg.warnings[0] and "ignored" in cfg.warnings[0]
    assert "optimizer_arguments" in cfg.warnings[0]


def test_lora_scripts_default_template_is_accepted():
    cfg = load(DATA / "lora_scripts_default.toml")
    assert cfg.train_data_dir == "./train/input" and cfg.save_last_n_epochs == 499
    assert cfg.log_prefix == "output_name" and cfg.caption_extension == ".txt"
    assert [w for w in cfg.warnings if "lr_restart_cycles" not in w] == []  # save_n_epoch_ratio = 0 is off


def test_gui_keys_warn_and_unimplemented_kohya_keys_warn(tmp_path, caplog):
    path = write(tmp_path, 'model_train_type = "sd-lora"\nconv_dim = 4\nlowram = true\nzero_terminal_snr = true\n'
                           'mem_eff_attn = true\nhighvram = false\n')
    with caplog.at_level("WARNING", logger="sd_scripts_compat.config.training_config"):
        cfg = load(path)
    text = "\n".join(cfg.warnings)
    assert "model_train_type" in text and "conv_dim" in text and 'network_args = ["conv_dim=4"' in text
    for name in ("lowram", "zero_terminal_snr", "mem_eff_attn"):
        assert f"{name}: sd-scripts option not implemented" in text
    assert "highvram" not in text  # at its default: nothing is lost
    assert len(caplog.records) == len(cfg.warnings) == 5
    assert cfg.raw["zero_terminal_snr"] is True


# --- precedence -----------------------------------------------------------------------------------

def test_command_line_overrides_toml_only_when_given(tmp_path):
    path = write(tmp_path, '[training]\nlearning_rate = 1e-4\nmax_train_steps = 500\nresolution = "768,768"\n'
                           'network_args = ["conv_dim=8"]\n')
    cfg = load(path, "--learning_rate", "5e-4", "--network_args", "conv_dim=2", "conv_alpha=1", "--flip_aug")
    assert cfg.learning_rate == 5e-4  # command line wins
    assert cfg.max_train_steps == 500  # TOML kept: not given on the command line
    assert cfg.resolution == (768, 768)
    assert cfg.network_args.entries == {"conv_dim": "2", "conv_alpha": "1"}
    assert cfg.flip_aug is True
    assert cfg.train_batch_size == 1 and cfg.mixed_precision == "no"  # kohya defaults
    assert cfg.given == {"config_file", "learning_rate", "max_train_steps", "resolution", "network_args",
                         "flip_aug"}
    assert cfg.raw["learning_rate"] == 5e-4


def test_later_section_wins_and_a_conflict_is_reported(tmp_path):
    path = write(tmp_path, '[a]\nseed = 1\nresolution = "512,512"\n[b]\nseed = 2\nresolution = "512,512"\n')
    cfg = load(path)
    assert cfg.seed == 2
    assert len(cfg.warnings) == 1 and "seed" in cfg.warnings[0] and "[a]" in cfg.warnings[0]


def test_command_line_only_without_config_file():
    cfg = load_training_config(["--resolution", "640", "--lr_warmup_steps", "0.25", "--lr_scheduler", "linear",
                                "--optimizer_type", "prodigy", "--optimizer_args", "d_coef=2", "decouple=True"],
                               sdxl=False)
    assert cfg.resolution == (640, 640) and cfg.warmup_steps(100) == 25
    assert cfg.optimizer_type == "Prodigy" and cfg.optimizer_args == {"d_coef": 2, "decouple": True}
    assert cfg.config_file is None


# --- errors ---------------------------------------------------------------------------------------

def test_unknown_key_names_file_key_and_closest(tmp_path):
    path = write(tmp_path, "[optimizer_arguments]\nlearning_rat = 1e-4\n")
    message = error_of(path)
    assert str(path) in message and "'learning_rat'" in message and "'learning_rate'" in message
    assert "optimizer_arguments" in message


def test_unknown_command_line_option_suggests_closest():
    with pytest.raises(UserError, match=r"--learning_rat.*did you mean --learning_rate\?"):
        load_training_config(["--learning_rat", "1e-4"], sdxl=False)


@pytest.mark.parametrize("line, expected", [
    ("resolution = 512", 'expected a string "W,H" such as "512,512", got integer 512'),
    ('learning_rate = "abc"', "expected a number, got string 'abc'"),
    ('learning_rate = "1e-4"', "without quotes"),
    ("max_train_steps = 1.5", "expected an integer, got float 1.5"),
    ('xformers = "true"', "expected true or false"),
    ('network_args = "conv_dim=4"', "expected a list of strings"),
    ("network_dim = true", "expected an integer, got boolean true"),
    ('mixed_precision = "FP16"', "did you mean 'fp16'?"),
    ("max_token_length = 255", "255 is not one of 150, 225 (or leave it out)"),
    ('resolution = "512x512"', 'got \'512x512\''),
    ("train_batch_size = 0", "must be 1 or more"),
    ("clip_skip = 0", "must be 1 or more"),
    ("learning_rate = nan", "finite"),
])
def test_bad_types_are_one_line_errors_naming_file_and_key(tmp_path, line, expected):
    path = write(tmp_path, f"[training_arguments]\n{line}\n")
    message = error_of(path)
    key = line.split(" ")[0]
    assert message.startswith(f"{path}: {key}") and expected in message


def test_bad_command_line_value_is_one_line():
    with pytest.raises(UserError, match="command line: argument --max_train_steps: invalid int value"):
        load_training_config(["--max_train_steps", "1.5"], sdxl=False)
    with pytest.raises(UserError, match="command line: --resolution"):
        load_training_config(["--resolution", "wide"], sdxl=False)


def test_malformed_toml_names_file_and_line(tmp_path):
    path = write(tmp_path, '[training]\nseed = 1\nlearning_rate = = 1e-4\n')
    message = error_of(path)
    assert message.startswith(f"{path}:3: malformed TOML")


def test_missing_config_file_and_toml_suffix(tmp_path):
    with pytest.raises(UserError, match="config file not found"):
        load_training_config(["--config_file", str(tmp_path / "nope.toml")], sdxl=False)
    write(tmp_path, "seed = 7\n", name="short.toml")
    # sd-scripts appends .toml when it is missing
    assert load_training_config(["--config_file", str(tmp_path / "short")], sdxl=False).seed == 7


def test_sdxl_only_keys_are_errors_for_the_sd1_entry_point(tmp_path):
    path = write(tmp_path, "cache_text_encoder_outputs = true\nnetwork_train_unet_only = true\n")
    assert "only for SDXL" in error_of(path)
    with pytest.raises(UserError, match="only for SDXL"):
        load_training_config(["--cache_text_encoder_outputs"], sdxl=False)
    cfg = load(path, sdxl=True)
    assert cfg.cache_text_encoder_outputs and cfg.sdxl
    # at its default value an SDXL-only key changes nothing on SD1: a warning, not an error
    cfg = load(write(tmp_path, "cache_text_encoder_outputs = false\n"))
    assert cfg.cache_text_encoder_outputs is False and "only for SDXL / FLUX.1" in cfg.warnings[0]
    assert "ignored by train_network" in cfg.warnings[0]


def test_sd_scripts_consistency_rules(tmp_path):
    # the default lr_scheduler (constant) with warmup steps: sd-scripts warns and trains without warmup; so do we
    cfg = load(write(tmp_path, "lr_warmup_steps = 10\n"))
    assert cfg.lr_warmup_steps == 0 and any("constant_with_warmup" in line for line in cfg.warnings)
    assert "AdaFactor's own schedule" in error_of(write(tmp_path, 'lr_scheduler = "adafactor"\n'))
    assert "not implemented by this engine" in error_of(write(tmp_path, "network_train_text_encoder_only = true\n"))
    assert "needs mixed_precision = \"fp16\"" in error_of(write(tmp_path, "full_fp16 = true\n"))
    assert "network_train_unet_only" in error_of(write(tmp_path, "cache_text_encoder_outputs = true\n"), sdxl=True)
    assert "v2 cannot" in error_of(write(tmp_path, "v2 = true\n"), sdxl=True)
    assert "safetensors only" in error_of(write(tmp_path, 'save_model_as = "ckpt"\n'))
    assert "does not implement" in error_of(write(tmp_path, 'optimizer_type = "DAdaptAdam"\n'))
    assert "did you mean 'AdamW8bit'" in error_of(write(tmp_path, 'optimizer_type = "AdamW8bitt"\n'))
    assert "does not implement" in error_of(write(tmp_path, 'lr_scheduler = "inverse_sqrt"\n'))
    assert "not supported" in error_of(write(tmp_path, 'network_module = "networks.dylora"\n'))
    assert "ratio in [0, 1)" in error_of(write(tmp_path, 'lr_scheduler = "linear"\nlr_warmup_steps = 2.5\n'))
    assert "not a Python literal" in error_of(write(tmp_path, 'optimizer_args = ["foo=bar"]\n'))
    assert "not key=value" in error_of(write(tmp_path, 'network_args = ["conv_dim"]\n'))
    # the SDXL text-encoder cache implies the cache, and _to_disk implies caching, as in sd-scripts
    cfg = load(write(tmp_path, "cache_text_encoder_outputs_to_disk = true\nnetwork_train_unet_only = true\n"
                               "cache_latents_to_disk = true\n"), sdxl=True)
    assert cfg.cache_text_encoder_outputs and cfg.cache_latents


def test_legacy_spellings_are_mapped(tmp_path):
    cfg = load(write(tmp_path, 'caption_extention = ".txt"\nuse_8bit_adam = true\n'))
    assert cfg.caption_extension == ".txt" and cfg.optimizer_type == "AdamW8bit"
    assert any("caption_extention" in w for w in cfg.warnings)


def test_config_is_frozen():
    cfg = load_training_config([], sdxl=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.learning_rate = 1.0  # type: ignore[misc]


def test_bad_file_shows_one_line_on_stderr_in_a_real_process(tmp_path):
    path = write(tmp_path, "[training_arguments]\nlearning_rat = 1e-4\n")
    script = (
        "import sys\n"
        "from sd_scripts_compat.config.training_config import load_training_config\n"
        "from sd_scripts_compat.facts.errors import UserError\n"
        "try:\n"
        "    load_training_config(sys.argv[1:], sdxl=False)\n"
        "except UserError as error:\n"
        "    print(f'train_network: error: {error}', file=sys.stderr)\n"
        "    sys.exit(error.exit_code)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", script, "--config_file", str(path)], capture_output=True,
                            text=True, env=env, cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "learning_rat" in lines[0] and "did you mean 'learning_rate'?" in lines[0]


# --- datasets from the training config ------------------------------------------------------------

def make_folders(root: Path, names: list[str]) -> None:
    for name in names:
        (root / name).mkdir(parents=True)


def test_train_data_dir_folder_convention(tmp_path, caplog):
    make_folders(tmp_path / "train", ["10_sks dog", "3_sks_cat", "notes", "0_empty"])
    (tmp_path / "train" / "readme.txt").write_text("not a folder")
    make_folders(tmp_path / "reg", ["1_dog"])
    path = write(tmp_path, f'train_data_dir = "{(tmp_path / "train").as_posix()}"\n'
                           f'reg_data_dir = "{(tmp_path / "reg").as_posix()}"\n'
                           'resolution = "512,768"\ntrain_batch_size = 2\nshuffle_caption = true\n'
                           'caption_extension = ".txt"\nprior_loss_weight = 0.5\nenable_bucket = true\n')
    cfg = load(path)
    with caplog.at_level("WARNING", logger="sd_scripts_compat.config.dataset_config"):
        group = dataset_group_from_config(cfg)
    assert len(group.datasets) == 1
    dataset = group.datasets[0]
    assert dataset.resolution == (512, 768) and dataset.batch_size == 2 and dataset.enable_bucket
    assert dataset.prior_loss_weight == 0.5
    summary = [(Path(s.image_dir).name, s.num_repeats, s.class_tokens, s.is_reg) for s in dataset.subsets]
    assert summary == [("10_sks dog", 10, "sks dog", False), ("3_sks_cat", 3, "sks_cat", False),
                       ("1_dog", 1, "dog", True)]
    assert all(s.shuffle_caption and s.caption_extension == ".txt" for s in dataset.subsets)
    skipped = " ".join(r.getMessage() for r in caplog.records)
    assert "'notes'" in skipped and "'0_empty'" in skipped


def test_train_data_dir_errors(tmp_path):
    (tmp_path / "train" / "images").mkdir(parents=True)
    cfg = load(write(tmp_path, f'train_data_dir = "{(tmp_path / "train").as_posix()}"\nresolution = "512"\n'))
    with pytest.raises(UserError, match="10_sks dog"):
        dataset_group_from_config(cfg)
    with pytest.raises(UserError, match="set train_data_dir"):
        dataset_group_from_config(load_training_config([], sdxl=False))
    cfg = load(write(tmp_path, f'train_data_dir = "{(tmp_path / "missing").as_posix()}"\n'))
    with pytest.raises(UserError, match="folder not found"):
        dataset_group_from_config(cfg)


def test_dataset_config_wins_over_train_data_dir(tmp_path):
    make_folders(tmp_path / "train", ["5_x"])
    dataset_toml = write(tmp_path, '[[datasets]]\n[[datasets.subsets]]\nimage_dir = "imgs"\n', name="ds.toml")
    cfg = load(write(tmp_path, f'train_data_dir = "{(tmp_path / "train").as_posix()}"\n'
                               f'dataset_config = "{dataset_toml.as_posix()}"\nresolution = "640,640"\n'))
    assert any("ignored because dataset_config" in w for w in cfg.warnings)
    group = dataset_group_from_config(cfg)
    assert [s.image_dir for s in group.datasets[0].subsets] == ["imgs"]
    assert group.datasets[0].resolution == (640, 640)


def test_the_reader_refuses_one_rate_per_text_encoder_and_keeps_one_for_all():
    """A config-only rule lives in the reader: refused before any model loads (autotune run's pre-flight reads
    the config with it), where the engine used to refuse it after loading the model."""
    with pytest.raises(UserError, match=r"text_encoder_lr: \[0.0001, 5e-05\]: one learning rate per text encoder"):
        load_training_config(["--text_encoder_lr", "1e-4", "5e-5"])
    assert load_training_config(["--text_encoder_lr", "5e-5", "5e-5"]).text_encoders_lr == 5e-5
    assert load_training_config([]).text_encoders_lr is None


def test_a_plan_for_several_cards_reads_without_a_warning(tmp_path):
    """``ddp_gradient_as_bucket_view`` (written into every plan over several cards for sd-scripts' DDP): this
    engine keeps no second copy of the gradients either way, so it takes the key without a word (held by
    construction, ``HELD_BY_CONSTRUCTION``), not as ignored;
    ``ddp_static_graph``, which it does not implement, still says so."""
    cfg = load(write(tmp_path, "ddp_gradient_as_bucket_view = true\nddp_timeout = 30\n"))
    assert not cfg.warnings and cfg.ddp_timeout == 30
    cfg = load(write(tmp_path, "ddp_static_graph = true\n"))
    assert "ddp_static_graph: sd-scripts option not implemented by this engine; ignored" in cfg.warnings[0]
