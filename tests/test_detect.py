"""The one family detector (sd_scripts_compat.models.detect): builtin ids, diffusers folders, single files,
stated families that agree or conflict, and the family facts it reads. Real files, written and re-read."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import family_names, get_family
from sd_scripts_compat.models.detect import detect_family, family_for_kohya_flags, known_family

SD1_TE = "cond_stage_model.transformer.text_model.final_layer_norm.weight"
SD2_TE = "cond_stage_model.model.ln_final.weight"
SDXL_TE = ("conditioner.embedders.0.transformer.text_model.final_layer_norm.weight",
           "conditioner.embedders.1.model.ln_final.weight")
CONV_IN = "model.diffusion_model.input_blocks.0.0.weight"


def header_file(path: Path, te_keys: tuple[str, ...], conv_in: tuple[int, ...] | None = None,
                metadata: dict[str, str] | None = None, v_pred: bool = False) -> Path:
    """A .safetensors whose header has a single-file layout's keys; detection reads only the header."""
    tensors = {"model.diffusion_model.out.0.weight": np.zeros(2, np.float16),
               **{key: np.zeros(2, np.float16) for key in te_keys}}
    if conv_in is not None:
        tensors[CONV_IN] = np.zeros(conv_in, np.float16)
    if v_pred:
        tensors["v_pred"] = np.zeros(0, np.float16)
    save_file(tensors, str(path), metadata=metadata)
    return path


def diffusers_folder(root: Path, name: str, *, unet: dict | None = None, prediction: str | None = None) -> Path:
    """A folder with only the configs a diffusers pipeline has (no weights: detection never reads them)."""
    family = get_family(name)
    part = "transformer" if family.is_transformer else "unet"  # FLUX pipelines keep a transformer/
    (root / part).mkdir(parents=True)
    (root / part / "config.json").write_text(json.dumps(unet if unet is not None else family.unet),
                                               encoding="utf-8")
    (root / "scheduler").mkdir()
    scheduler = {**family.scheduler, **({"prediction_type": prediction} if prediction else {})}
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(scheduler), encoding="utf-8")
    return root


def test_builtin_ids_and_their_errors():
    for name in family_names():
        assert detect_family(f"builtin:{name}").name == name
        assert detect_family(f"builtin:{name}", name).name == name
    with pytest.raises(UserError, match="unknown built-in model builtin:sd3") as info:
        detect_family("builtin:sd3")
    assert all(f"builtin:{name}" in str(info.value) for name in family_names())
    with pytest.raises(UserError, match="builtin:sd15 is a sd15 model but family sdxl was requested; drop --family"):
        detect_family("builtin:sd15", "sdxl")
    with pytest.raises(UserError, match="unknown model family 'sd3'"):
        detect_family("builtin:sd15", "sd3")
    with pytest.raises(UserError, match="unknown model family 'sd3' \\(the family option\\)"):
        known_family("sd3", "the family option")


def test_every_family_is_told_apart_by_its_diffusers_configs(tmp_path):
    for name in family_names():
        assert detect_family(str(diffusers_folder(tmp_path / name, name))).name == name


def test_diffusers_folder_prediction_type_and_stated_family(tmp_path):
    # an SD2 folder whose scheduler says v_prediction is the 768-v family
    assert detect_family(str(diffusers_folder(tmp_path / "v", "sd2", prediction="v_prediction"))).name == "sd2-v"
    sd2 = diffusers_folder(tmp_path / "eps", "sd2")
    with pytest.raises(UserError, match=f"{sd2} is a sd2 model but family sd2-v was requested"):
        detect_family(str(sd2), "sd2-v")  # the scheduler says epsilon: a contradiction
    with pytest.raises(UserError, match="is a sd15 model but family sdxl was requested") as info:
        detect_family(str(diffusers_folder(tmp_path / "15", "sd15")), "sdxl")
    assert "\n" not in str(info.value)
    odd = diffusers_folder(tmp_path / "odd", "sd15", unet={"cross_attention_dim": 4096})
    with pytest.raises(UserError, match="cross_attention_dim 4096.*match no known family.*--family"):
        detect_family(str(odd))
    assert detect_family(str(odd), "sdxl").name == "sdxl"  # nothing to contradict: the statement is trusted
    bare = diffusers_folder(tmp_path / "bare", "sd15", unet={"in_channels": 4})
    with pytest.raises(UserError, match="cross_attention_dim None, block_out_channels None match no known family"):
        detect_family(str(bare))
    (tmp_path / "nothing").mkdir()
    with pytest.raises(UserError, match="no unet/config.json"):
        detect_family(str(tmp_path / "nothing"))


def test_single_file_headers(tmp_path):
    cases = [
        ("sd15", header_file(tmp_path / "a.safetensors", (SD1_TE,), conv_in=(320, 4, 3, 3))),
        ("tiny-sd15", header_file(tmp_path / "b.safetensors", (SD1_TE,), conv_in=(32, 4, 3, 3))),
        ("sd2", header_file(tmp_path / "c.safetensors", (SD2_TE,))),
        ("sd2-v", header_file(tmp_path / "d.safetensors", (SD2_TE,), v_pred=True)),
        ("sd2-v", header_file(tmp_path / "e.safetensors", (SD2_TE,), metadata={"modelspec.prediction_type": "v"})),
        ("sdxl", header_file(tmp_path / "f.safetensors", SDXL_TE, conv_in=(320, 4, 3, 3))),
        ("tiny-sdxl", header_file(tmp_path / "g.safetensors", SDXL_TE, conv_in=(32, 4, 3, 3))),
    ]
    for expected, path in cases:
        assert detect_family(str(path)).name == expected, path.name
    files = dict(cases)
    # no marker: an SD2 file is taken as sd2 unless the user says sd2-v; a marker the statement contradicts fails
    assert detect_family(str(files["sd2"]), "sd2-v").name == "sd2-v"
    with pytest.raises(UserError, match="d.safetensors is a sd2-v checkpoint but family sd2 was requested"):
        detect_family(str(tmp_path / "d.safetensors"), "sd2")
    with pytest.raises(UserError, match="is a tiny-sd15 checkpoint but family sd15 was requested"):
        detect_family(str(files["tiny-sd15"]), "sd15")
    odd = header_file(tmp_path / "odd.safetensors", (SD1_TE,), conv_in=(64, 4, 3, 3))
    with pytest.raises(UserError, match="first UNet convolution matches no known family"):
        detect_family(str(odd))


def test_single_file_not_a_model(tmp_path):
    lora = tmp_path / "style.safetensors"
    save_file({"lora_unet_down_blocks_0.lora_down.weight": np.zeros((4, 8), np.float16)}, str(lora))
    with pytest.raises(UserError, match="is a LoRA file, not a base model"):
        detect_family(str(lora))


def test_files_that_cannot_be_read_cheaply(tmp_path):
    ckpt = tmp_path / "model.ckpt"
    ckpt.write_bytes(b"not read")
    with pytest.raises(UserError, match="cannot tell the family of a .ckpt file.*--family"):
        detect_family(str(ckpt))
    assert detect_family(str(ckpt), "sd15").name == "sd15"
    with pytest.raises(UserError, match="not found"):
        detect_family(str(tmp_path / "missing.safetensors"))
    # a model that is elsewhere (templates, planning for another machine) takes the stated family
    assert detect_family(str(tmp_path / "missing.safetensors"), "sd2").name == "sd2"


def test_cheap_and_strict_detection_agree_on_a_real_checkpoint(tmp_path):
    """A real tiny single file: the header-only detector and the engine's loader (every shape) say the same."""
    from sd_scripts_compat.models.build import build_modules
    from sd_scripts_compat.models.single_file import save_single_file
    from sd_scripts_compat.runtimes import load_base_model

    path = save_single_file(build_modules(get_family("tiny-sdxl"), seed=3), tmp_path / "tiny.safetensors")
    assert detect_family(str(path)).name == "tiny-sdxl"
    assert load_base_model(str(path), device="meta").family.name == "tiny-sdxl"


def test_kohya_flags_name_a_family():
    assert family_for_kohya_flags(False, False) is None and family_for_kohya_flags(False, True) is None
    assert family_for_kohya_flags(True, False) == get_family("sd2")
    assert family_for_kohya_flags(True, True) == get_family("sd2-v")


def test_family_facts_are_consistent():
    """The facts code reads instead of branching on names agree with the rest of each family file."""
    # sd-scripts' script of each transformer class (SD3, Lumina, HunyuanImage and Anima have their own)
    transformer_scripts = {"FluxTransformer2DModel": "flux_train_network.py",
                           "ChromaTransformer2DModel": "flux_train_network.py",
                           "SD3Transformer2DModel": "sd3_train_network.py",
                           "Lumina2Transformer2DModel": "lumina_train_network.py",
                           "HunyuanImageTransformer2DModel": "hunyuan_image_train_network.py",
                           "CosmosTransformer3DModel": "anima_train_network.py",
                           # musubi-tuner's scripts (it trains these; their files are its own layout)
                           "QwenImageTransformer2DModel": "qwen_image_train_network.py",
                           "Flux2Transformer2DModel": "flux_2_train_network.py",
                           "WanTransformer3DModel": "wan_train_network.py",
                           "ZImageTransformer2DModel": "zimage_train_network.py"}
    for name in family_names():
        f = get_family(name)
        script = transformer_scripts[f.denoiser_class] if f.is_transformer else (
            "sdxl_train_network.py" if f.is_sdxl else "train_network.py")
        assert f.kohya_script == script, name
        assert f.engine_module == "sd_scripts_compat." + f.kohya_script[:-3]
        if f.trained_here:
            assert importlib.util.find_spec(f.engine_module) is not None, name
        assert f.v2 == f.ss_base_model_version.startswith("sd_v2"), name
        own_layouts = {"sd3_train_network.py": "sd3", "lumina_train_network.py": "lumina2",
                       "hunyuan_image_train_network.py": "hunyuan_image", "anima_train_network.py": "anima"}
        layout = ("musubi" if f.trainer == "musubi-tuner" else own_layouts.get(f.kohya_script, "flux")
                  if f.is_transformer else "sdxl" if f.is_sdxl else "sd2" if f.v2 else "sd1")
        assert f.single_file_layout == layout, name
        if "block_out_channels" in f.vae and "spatial_compression_ratio" not in f.vae:
            assert f.latent_downsample == 2 ** (len(f.vae["block_out_channels"]) - 1)
        if not f.tiny and not f.is_transformer:
            assert f.latent_downsample == 8 and f.resolution // f.latent_downsample == f.unet["sample_size"]
