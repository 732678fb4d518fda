"""Transformer and T5 files of fewer blocks than their family, read as sd-scripts reads them
(``models.file_depth``): a pruned FLUX.1, an SD3 MMDiT sized from its file, a T5 of one layer. Real files written
from tiny twins at a smaller depth, detected, loaded with equal weights, and trained by our engine."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fixtures.engine_runs import run_engine, toy_dataset

from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import get_family
from sd_scripts_compat.models.build import build_modules
from sd_scripts_compat.models.detect import detect_family
from sd_scripts_compat.models.file_depth import file_geometry
from sd_scripts_compat.models.flux_files import save_flux_files
from sd_scripts_compat.models.sd3_files import save_sd3_files, swapped_halves
from sd_scripts_compat.network.lora_file import read_lora_file
from sd_scripts_compat.runtimes import load_base_model


def shallower(name: str, t5_layers: int = 1, **unet) -> object:
    """The family with fewer blocks and a T5 of ``t5_layers`` layers."""
    spec = get_family(name)
    encoders = tuple(dataclasses.replace(te, config={**te.config, "num_layers": t5_layers})
                     if te.file_option == "t5xxl" else te for te in spec.text_encoders)
    return dataclasses.replace(spec, unet={**spec.unet, **unet}, text_encoders=encoders)


def same_weights(source, loaded) -> None:
    for ours, theirs in ((source.unet, loaded.unet), *zip(source.text_encoders, loaded.text_encoders)):
        loaded_state = theirs.state_dict()
        for key, value in ours.state_dict().items():
            assert torch.equal(loaded_state[key], value), key


@pytest.fixture(scope="module")
def flux_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pruned-flux")
    source = build_modules(shallower("tiny-flux", num_layers=1, num_single_layers=1), seed=5)
    return source, save_flux_files(source, folder)


def test_a_pruned_flux_file_is_its_family_at_the_files_depth(flux_files):
    source, files = flux_files
    model = str(files["pretrained_model_name_or_path"])
    assert detect_family(model).name == "tiny-flux"
    loaded = load_base_model(model, clip_l=str(files["clip_l"]), t5xxl=str(files["t5xxl"]), ae=str(files["ae"]))
    assert loaded.family.name == "tiny-flux"
    assert (len(loaded.unet.transformer_blocks), len(loaded.unet.single_transformer_blocks)) == (1, 1)
    assert (loaded.family.unet["num_layers"], loaded.family.unet["num_single_layers"]) == (1, 1)
    assert len(loaded.text_encoders[1].encoder.block) == 1 and loaded.family.text_encoders[1].config["num_layers"] == 1
    same_weights(source, loaded)
    # the family's own files change nothing: the spec is the registry's
    full = build_modules(get_family("tiny-flux"), device="meta")
    from sd_scripts_compat.models.flux_layout import to_bfl

    shapes = {key: tuple(value.shape) for key, value in to_bfl(full.unet.state_dict(), full.unet.config).items()}
    assert file_geometry(get_family("tiny-flux"), shapes) == {}


def test_our_engine_trains_a_pruned_flux_file(tmp_path, flux_files):
    _, files = flux_files
    values = {"pretrained_model_name_or_path": str(files["pretrained_model_name_or_path"]),
              **{option: str(files[option]) for option in ("clip_l", "t5xxl", "ae")},
              "train_data_dir": str(toy_dataset(tmp_path)), "output_dir": str(tmp_path / "out"),
              "output_name": "pruned", "resolution": "64,64", "caption_extension": ".txt", "train_batch_size": 1,
              "max_train_steps": 2, "network_dim": 4, "network_alpha": 4, "learning_rate": 1e-3, "seed": 3,
              "max_data_loader_n_workers": 0, "network_train_unet_only": True, "t5xxl_max_token_length": 16,
              "model_prediction_type": "raw", "timestep_sampling": "shift", "guidance_scale": 1.0}
    run_engine("flux_train_network", tmp_path, values)
    state, _ = read_lora_file(tmp_path / "out" / "pruned.safetensors")
    blocks = {key.split(".")[0].split("_blocks_")[1].split("_")[0] for key in state if "_blocks_" in key}
    assert blocks == {"0"}
    assert any(key.startswith("lora_unet_single_blocks_0_") for key in state)


def test_a_shallower_sd3_file_swaps_the_rows_of_its_own_last_block(tmp_path):
    source = build_modules(shallower("tiny-sd3", num_layers=2), seed=4)
    files = save_sd3_files(source, tmp_path, text_encoders_inside=False)
    model = str(files["pretrained_model_name_or_path"])
    assert detect_family(model).name == "tiny-sd3"
    loaded = load_base_model(model, **{option: str(files[option]) for option in ("clip_l", "clip_g", "t5xxl")})
    assert len(loaded.unet.transformer_blocks) == 2 and loaded.family.unet["num_layers"] == 2
    same_weights(source, loaded)
    # SD3's last (pre-only) block is the file's last: its context modulation is the one written the other way
    assert "joint_blocks.1.context_block.adaLN_modulation.1" in swapped_halves(loaded.family)


def test_an_sd3_file_at_sd_scripts_sizing_is_sd35_medium_by_its_mmdit_x_blocks(tmp_path):
    """sd-scripts' sizing (64 x depth wide, one head per block) at depth 2 with MMDiT-X attention in block 0: the
    family with that marker (Medium), read from the header alone; without the attention, Large."""
    from safetensors.torch import save_file

    from sd_scripts_compat.models.sd3_files import to_sd3

    for dual, wanted in (([0], "sd3.5-medium"), ([], "sd3.5-large")):
        spec = shallower("sd3.5-medium", num_layers=2, num_attention_heads=2, caption_projection_dim=128,
                         dual_attention_layers=dual)
        bundle = build_modules(spec, device="meta")
        header = {f"model.diffusion_model.{key}": torch.empty(0) for key in to_sd3(bundle.unet.state_dict(), spec)}
        path = tmp_path / f"mmdit-{len(dual)}.safetensors"
        shapes = {key: tuple(value.shape) for key, value in to_sd3(bundle.unet.state_dict(), spec).items()}
        save_file({key: torch.zeros(shapes[key.removeprefix("model.diffusion_model.")]) for key in header},
                  str(path))
        assert detect_family(str(path)).name == wanted
        assert file_geometry(get_family(wanted), shapes)["num_layers"] == 2


def test_a_file_with_more_blocks_than_any_family_is_still_one_line(tmp_path):
    source = build_modules(shallower("tiny-flux", num_layers=3, num_single_layers=1), seed=5)
    files = save_flux_files(source, tmp_path)
    with pytest.raises(UserError, match="matches no known family"):
        detect_family(str(files["pretrained_model_name_or_path"]))


def test_a_t5_file_with_more_layers_than_the_familys_is_one_line(tmp_path):
    family = get_family("tiny-flux")
    layers = int(next(te for te in family.text_encoders if te.file_option == "t5xxl").config["num_layers"])
    files = save_flux_files(build_modules(shallower("tiny-flux", t5_layers=layers + 1), seed=5), tmp_path)
    with pytest.raises(UserError, match="t5xxl") as refused:
        load_base_model(str(files["pretrained_model_name_or_path"]), clip_l=str(files["clip_l"]),
                        t5xxl=str(files["t5xxl"]), ae=str(files["ae"]))
    assert "\n" not in str(refused.value)


def test_blocks_to_swap_is_checked_against_the_blocks_the_file_has(flux_files):
    """The pruned model's own blocks bound blocks_to_swap (tiny-flux swaps up to 2 at its family's depth)."""
    from sd_scripts_compat.training.block_swap import check_blocks_to_swap

    _, files = flux_files
    loaded = load_base_model(str(files["pretrained_model_name_or_path"]), clip_l=str(files["clip_l"]),
                             t5xxl=str(files["t5xxl"]), ae=str(files["ae"]))
    assert check_blocks_to_swap(get_family("tiny-flux"), 2) == (1, 2)
    with pytest.raises(UserError, match=r"tiny-flux \(1 double, 1 single blocks\) swaps none; remove blocks_to_swap"):
        check_blocks_to_swap(loaded.family, 2)
