"""network_args from a config on disk to the LoRA network, as sd-scripts' network modules read them.

Each key that ``networks.lora`` / ``networks.lora_flux`` read is typed and trains, or is refused before
anything loads with one line naming it. Key sets are checked on the full-size models (meta device)
against the lists kohya's own code produces (``tests/data/kohya``); the block numbering and weights
are checked against sd-scripts' arithmetic worked out by hand here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from sd_scripts_compat.config.network_args import block_count, block_lr_weight, parse_network_args, read_module_keys
from sd_scripts_compat.config.training_config import load_training_config
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import get_family
from sd_scripts_compat.models.build import build_modules
from sd_scripts_compat.network.lora import block_index, create_network
from sd_scripts_compat.network.lora_file import read_lora_file
from sd_scripts_compat.runtimes import load_base_model

REFERENCE = Path(__file__).parent / "data" / "kohya"

# a valid value for every key sd-scripts' networks.lora and networks.lora_flux read
SAMPLES = {
    "conv_dim": "4", "conv_alpha": "1", "rank_dropout": "0.1", "module_dropout": "0.1", "train_t5xxl": "True",
    "train_blocks": "double", "verbose": "True", "loraplus_lr_ratio": "16", "loraplus_unet_lr_ratio": "16",
    "loraplus_text_encoder_lr_ratio": "4", "down_lr_weight": "cosine", "mid_lr_weight": "0.5",
    "up_lr_weight": "1,1,1", "block_lr_zero_threshold": "0.1", "block_dims": ",".join(["4"] * 25),
    "block_alphas": ",".join(["2"] * 25), "conv_block_dims": ",".join(["2"] * 25),
    "conv_block_alphas": ",".join(["1"] * 25), "split_qkv": "True", "ggpo_beta": "0.01", "ggpo_sigma": "0.03",
    "img_attn_dim": "8", "img_mlp_dim": "8", "img_mod_dim": "8", "txt_attn_dim": "8", "txt_mlp_dim": "8",
    "txt_mod_dim": "8", "single_dim": "8", "single_mod_dim": "8", "in_dims": "[4,0,0,0,0]",
    "network_reg_dims": "attn=8", "network_reg_lrs": "attn=1e-4", "train_double_block_indices": "0-3",
    "train_single_block_indices": "0-3",
}
TRAINED = {
    "networks.lora": {"conv_dim", "conv_alpha", "rank_dropout", "module_dropout", "loraplus_lr_ratio",
                      "loraplus_unet_lr_ratio", "loraplus_text_encoder_lr_ratio", "down_lr_weight",
                      "mid_lr_weight", "up_lr_weight", "block_lr_zero_threshold", "block_dims", "block_alphas",
                      "conv_block_dims", "conv_block_alphas"},
    "networks.lora_flux": {"rank_dropout", "module_dropout", "train_t5xxl", "train_blocks", "verbose",
                           "loraplus_lr_ratio", "loraplus_unet_lr_ratio", "loraplus_text_encoder_lr_ratio"},
}


def write_config(tmp_path: Path, network_args: list[str], *, module: str | None = None, dim: int = 16,
                 alpha: float = 8) -> Path:
    lines = [f"network_dim = {dim}", f"network_alpha = {alpha}", f"network_args = {json.dumps(network_args)}"]
    if module:
        lines.append(f'network_module = "{module}"')
    path = tmp_path / "config.toml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def config_args(tmp_path: Path, network_args: list[str], script: str = "train_network", **kwargs):
    path = write_config(tmp_path, network_args, **kwargs)
    return load_training_config(["--config_file", str(path)], script=script).network_args


@pytest.mark.parametrize("module", sorted(TRAINED))
def test_every_key_the_module_reads_is_typed_or_refused_with_its_name(module):
    keys = read_module_keys()[module]
    assert keys >= TRAINED[module]
    for key in sorted(keys):
        entries = {key: SAMPLES[key]}
        if key in ("block_alphas", "conv_block_dims", "conv_block_alphas", "block_lr_zero_threshold"):
            entries["block_dims"] = SAMPLES["block_dims"]
        if key == "conv_block_alphas":
            entries["conv_block_dims"] = SAMPLES["conv_block_dims"]
        if key in TRAINED[module]:
            parsed = parse_network_args(entries, module)
            assert parsed.entries == entries
        else:
            with pytest.raises(UserError, match=key):
                parse_network_args(entries, module)


def test_refusals_name_the_key_and_the_fix():
    with pytest.raises(UserError, match="network_dropout"):
        parse_network_args({"dropout": "0.1"}, "networks.lora")
    with pytest.raises(UserError, match="does not read 'conv_dims'.*did you mean 'conv_dim'"):
        parse_network_args({"conv_dims": "4"}, "networks.lora")
    with pytest.raises(UserError, match="conv_dim='four' is not a valid int"):
        parse_network_args({"conv_dim": "four"}, "networks.lora")
    with pytest.raises(UserError, match='exact word "True"'):  # sd-scripts reads "true" as False
        parse_network_args({"train_t5xxl": "true"}, "networks.lora_flux")
    with pytest.raises(UserError, match="must be in \\[0, 1\\)"):
        parse_network_args({"rank_dropout": "1.5"}, "networks.lora")
    with pytest.raises(UserError, match="finite"):
        parse_network_args({"loraplus_lr_ratio": "nan"}, "networks.lora")
    with pytest.raises(UserError, match="block_dims must have 25 values"):
        parse_network_args({"block_dims": "4,4,4"}, "networks.lora")
    with pytest.raises(UserError, match="block_dims must have 23 values"):
        parse_network_args({"block_dims": ",".join(["4"] * 25)}, "networks.lora", sdxl=True)
    with pytest.raises(UserError, match="down_lr_weight has 13 values"):
        parse_network_args({"down_lr_weight": ",".join(["1"] * 13)}, "networks.lora")
    with pytest.raises(UserError, match="block_alphas takes effect only with block_dims"):
        parse_network_args({"block_alphas": ",".join(["1"] * 25)}, "networks.lora")
    with pytest.raises(UserError, match="FLUX's LoRA targets have no convolutions"):
        parse_network_args({"conv_dim": "4"}, "networks.lora_flux")


def test_block_lr_weights_follow_sd_scripts_arithmetic():
    # SD 1/2: 12 down + 1 mid + 12 up; a short list is filled with 1.0; empty entries are 0
    weights = block_lr_weight({"down_lr_weight": (0.5, 0.0), "mid_lr_weight": (2.0,)}, sdxl=False, where="x")
    assert weights == (0.5, 0.0) + (1.0,) * 10 + (2.0,) + (1.0,) * 12
    assert parse_network_args({"down_lr_weight": "1,,1"}, "networks.lora").block_lr_weight[:3] == (1.0, 0.0, 1.0)
    # SDXL: 1.0 for emb_layers and out around 9 + 3 + 9; presets over 9 blocks; threshold zeroes small weights
    weights = block_lr_weight({"up_lr_weight": "sine", "block_lr_zero_threshold": 0.2}, sdxl=True, where="x")
    sine = [math.sin(math.pi * (i / 8) / 2) for i in range(9)]
    assert len(weights) == block_count(sdxl=True) == 23
    assert weights[0] == weights[-1] == 1.0 and weights[1:13] == (1.0,) * 12
    assert weights[13:22] == tuple(w if w > 0.2 else 0.0 for w in sine)
    cosine = parse_network_args({"down_lr_weight": "cosine+0.5"}, "networks.lora").block_lr_weight[:12]
    assert cosine == pytest.approx([math.sin(math.pi * (i / 11) / 2) + 0.5 for i in reversed(range(12))])


@pytest.mark.parametrize(("name", "sdxl", "index"), [
    # SD 1/2 (diffusers names): down 1 + 3i + j, downsamplers 1 + 3i + 2, mid 12, up 13 + 3i + j
    ("lora_unet_down_blocks_0_attentions_0_proj_in", False, 1),
    ("lora_unet_down_blocks_1_attentions_1_transformer_blocks_0_attn1_to_q", False, 5),
    ("lora_unet_down_blocks_2_downsamplers_0_conv", False, 9),
    ("lora_unet_down_blocks_3_resnets_1_conv1", False, 11),
    ("lora_unet_mid_block_attentions_0_proj_out", False, 12),
    ("lora_unet_up_blocks_0_resnets_2_conv2", False, 15),
    ("lora_unet_up_blocks_3_attentions_2_proj_out", False, 24),
    # SDXL (SGM names): input 1 + n, middle 10 + n, output 13 + n
    ("lora_unet_input_blocks_4_1_proj_in", True, 5),
    ("lora_unet_middle_block_1_transformer_blocks_0_ff_net_2", True, 11),
    ("lora_unet_output_blocks_8_0_skip_connection", True, 21),
])
def test_block_numbers_are_sd_scripts(name, sdxl, index):
    assert block_index(name, sdxl) == index


def _reference(name: str) -> dict:
    return json.loads((REFERENCE / name).read_text())


@pytest.mark.parametrize(("family", "script", "reference"), [("sd15", "train_network", "keys_sd15_conv.json"),
                                                             ("sdxl", "sdxl_train_network", "keys_sdxl_conv.json")])
def test_locon_from_a_config_file_has_kohyas_keys(tmp_path, family, script, reference):
    args = config_args(tmp_path, ["conv_dim=4", "conv_alpha=1", "rank_dropout=0.1", "module_dropout=0.1"],
                       script=script)
    network = create_network(build_modules(get_family(family), device="meta"), network_dim=16, network_alpha=8,
                             args=args)
    state = network.kohya_state_dict()
    assert {k: [list(v.shape), str(v.dtype)] for k, v in state.items()} == _reference(reference)
    assert {lora.rank_dropout for lora in network.loras()} == {0.1}


def test_flux_t5_from_a_config_file_has_kohyas_keys(tmp_path):
    args = config_args(tmp_path, ["train_t5xxl=True"], script="flux_train_network")
    network = create_network(load_base_model("builtin:flux-dev", device="meta"), network_dim=16, network_alpha=8,
                             args=args)
    assert {k: [list(v.shape), str(v.dtype)] for k, v in network.kohya_state_dict().items()} == \
        _reference("keys_flux_dev_t5.json")
    double = create_network(load_base_model("builtin:flux-dev", device="meta"), network_dim=16, network_alpha=8,
                            args=config_args(tmp_path, ["train_blocks=double"], script="flux_train_network"))
    unet_keys = {k for k in _reference("keys_flux_dev.json") if k.startswith("lora_unet_")}
    assert {k for k in double.kohya_state_dict() if k.startswith("lora_unet_")} == \
        {k for k in unet_keys if k.startswith("lora_unet_double_blocks_")}


def test_block_weights_and_dims_shape_the_modules_full_size_sd15(tmp_path):
    zero_down = ",".join(["0"] * 12)
    dims = ["4"] * 25
    dims[12] = "8"  # the mid block
    args = config_args(tmp_path, [f"down_lr_weight={zero_down}", f"block_dims={','.join(dims)}",
                                  "conv_dim=2"])
    state = create_network(build_modules(get_family("sd15"), device="meta"), network_dim=16, network_alpha=8,
                           args=args).kohya_state_dict()
    reference = _reference("keys_sd15_conv.json")
    expected = {k for k in reference if "down_blocks" not in k}
    assert set(state) == expected  # a block whose lr weight is 0 gets no module
    assert state["lora_unet_mid_block_attentions_0_proj_in.lora_down.weight"].shape[0] == 8
    assert state["lora_unet_up_blocks_1_attentions_0_proj_in.lora_down.weight"].shape[0] == 4
    assert state["lora_unet_up_blocks_1_resnets_0_conv1.lora_down.weight"].shape[0] == 2
    assert state["lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight"].shape[0] == 16  # TE: network_dim


def test_loraplus_and_block_weights_make_sd_scripts_groups():
    bundle = load_base_model("builtin:tiny-sd15")
    args = parse_network_args({"loraplus_unet_lr_ratio": "16", "loraplus_text_encoder_lr_ratio": "4"},
                              "networks.lora")
    network = create_network(bundle, network_dim=4, network_alpha=4, args=args)
    groups = network.prepare_optimizer_params(text_encoder_lr=5e-5, unet_lr=None, default_lr=1e-4)
    assert [g["lr"] for g in groups] == [5e-5, 2e-4, 1e-4, 1.6e-3]
    up = {id(lora.lora_up.weight) for lora in network.loras()}
    assert [all(id(p) in up for p in g["params"]) for g in groups] == [False, True, False, True]
    assert sum(len(g["params"]) for g in groups) == len(list(network.parameters()))
    # block weights: one group per block, lr x weight; blocks at 0 have no modules at all
    args = parse_network_args({"mid_lr_weight": "0.5", "up_lr_weight": "0,0,0,0,0,0,0,0,0,0,0,0"}, "networks.lora")
    network = create_network(bundle, network_dim=4, network_alpha=4, args=args, train_text_encoder=False)
    assert not any("up_blocks" in lora.lora_name for lora in network.unet_loras)
    groups = network.prepare_optimizer_params(None, None, 1e-4)
    mid = [lora.lora_down.weight for lora in network.unet_loras if "mid_block" in lora.lora_name]
    mid_group = next(g for g in groups if any(p is mid[0] for p in g["params"]))
    assert mid_group["lr"] == 5e-5 and len(mid_group["params"]) == 2 * len(mid)
    assert {g["lr"] for g in groups} == {1e-4, 5e-5}
    optimizer = torch.optim.AdamW(groups)
    assert len(optimizer.param_groups) == len(groups)


# ---- end to end: a config on disk -> the engine -> a LoRA file -----------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize(("model", "sdxl", "network_args"), [
    ("builtin:tiny-sd15", False, ["conv_dim=2", "conv_alpha=1", "rank_dropout=0.1", "module_dropout=0.1",
                                  "loraplus_lr_ratio=8", "mid_lr_weight=0.5",
                                  "up_lr_weight=0,0,0,0,0,0,0,0,0,0,0,0"]),
    ("builtin:tiny-sdxl", True, [f"block_dims={','.join(['4'] * 12 + ['6'] * 11)}",
                                 "conv_block_dims=" + ",".join(["2"] * 23), "loraplus_unet_lr_ratio=4"]),
])
def test_engine_trains_network_args_from_a_config_file(tmp_path, model, sdxl, network_args):
    from tests.test_train_engine import base_config, lora_tensors, run_engine
    from tests.test_train_engine import write_config as write_toml

    values = base_config(tmp_path, model=model, max_train_steps=3, network_args=network_args)
    config = write_toml(tmp_path / "config.toml", values)
    run_engine(config, sdxl=sdxl)
    written = lora_tensors(tmp_path / "out" / "lora.safetensors")
    script = "sdxl_train_network" if sdxl else "train_network"
    args = load_training_config(["--config_file", str(config)], script=script).network_args
    expected = create_network(load_base_model(model), network_dim=4, network_alpha=4, args=args).kohya_state_dict()
    assert {k: list(v.shape) for k, v in written.items()} == {k: list(v.shape) for k, v in expected.items()}
    assert any(v.dim() == 4 and v.shape[-1] == 3 for v in written.values())  # LoCon modules on 3x3 convs
    # every UNet module trained (none frozen by a group left out; SDXL's last CLIP layer is unused, so its
    # text-encoder LoRA rightly stays at zero, as in sd-scripts)
    assert [k for k, v in written.items() if k.startswith("lora_unet") and k.endswith("lora_up.weight")
            and not v.abs().sum()] == []
    metadata = json.loads(__import__("safetensors").safe_open(
        str(tmp_path / "out" / "lora.safetensors"), "pt").metadata()["ss_network_args"])
    assert metadata == {**dict(item.split("=", 1) for item in network_args), "dropout": None}  # as sd-scripts adds it


@pytest.mark.slow
def test_flux_engine_trains_t5_and_double_blocks_from_a_config_file(tmp_path):
    from tests.test_flux_engine import base_config, run_flux

    values = base_config(tmp_path, max_train_steps=3, network_train_unet_only=False,
                         network_args=["train_t5xxl=True", "train_blocks=double", "loraplus_lr_ratio=4"])
    run_flux(tmp_path, values)
    written = read_lora_file(tmp_path / "out" / "flux.safetensors")[0]
    assert any(k.startswith("lora_te3_") for k in written) and any(k.startswith("lora_te1_") for k in written)
    unet = {k for k in written if k.startswith("lora_unet_")}
    assert unet and all(k.startswith("lora_unet_double_blocks_") for k in unet)


def test_engine_refuses_an_unimplemented_key_in_one_line_before_loading(tmp_path):
    import subprocess
    import sys

    config = write_config(tmp_path, ["split_qkv=True"], module="networks.lora_flux")
    result = subprocess.run([sys.executable, "-m", "sd_scripts_compat.flux_train_network", "--config_file",
                             str(config), "--pretrained_model_name_or_path", str(tmp_path / "missing.safetensors")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "split_qkv" in lines[0] and "Traceback" not in result.stderr
    assert "missing.safetensors" not in lines[0]  # refused before the model is even looked at


# ---- in sd-scripts itself (a local checkout: LORA_AUTOTUNE_SD_SCRIPTS; never in CI) ------------------------

_LOAD_IN_SD_SCRIPTS = r"""
import networks.lora as lora
from safetensors.torch import load_file
weights = load_file(sys.argv[3])
network, _ = lora.create_network_from_weights(1.0, None, None, te, unet, weights_sd=weights)
network.apply_to(te, unet, True, True)  # registers the modules, as train_network does before loading
network.load_state_dict(weights, strict=True)
print(len(network.unet_loras), len(network.text_encoder_loras))
"""


@pytest.mark.parametrize(("family", "script", "reference"), [("sd15", "train_network", "keys_sd15_conv.json"),
                                                             ("sdxl", "sdxl_train_network", "keys_sdxl_conv.json")])
def test_locon_file_loads_strictly_in_sd_scripts_networks_lora(tmp_path, family, script, reference):
    import subprocess

    from sd_scripts_compat.network.lora_file import save_lora_file
    from tests.fixtures.local import SD_SCRIPTS_MODELS, sd_scripts

    checkout, python = sd_scripts()
    if python is None:
        pytest.skip("needs LORA_AUTOTUNE_SD_SCRIPTS (+ _PYTHON): a local sd-scripts checkout and its venv")
    args = config_args(tmp_path, ["conv_dim=4", "conv_alpha=1"], script=script)
    meta = create_network(build_modules(get_family(family), device="meta"), network_dim=16, network_alpha=8,
                          args=args).kohya_state_dict()
    state = {k: torch.full(v.shape, 8.0) if k.endswith(".alpha") else torch.zeros(v.shape) for k, v in meta.items()}
    path = tmp_path / "locon.safetensors"
    save_lora_file(path, state, {"ss_network_args": json.dumps(args.entries)})
    result = subprocess.run([str(python), "-c", SD_SCRIPTS_MODELS + _LOAD_IN_SD_SCRIPTS, str(checkout), family,
                             str(path)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[:1500]
    unet_modules, te_modules = map(int, result.stdout.split()[-2:])
    expected = _reference(reference)
    assert 3 * (unet_modules + te_modules) == len(expected)
