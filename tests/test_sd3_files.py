"""SD3 / SD3.5 files as sd-scripts' sd3_train_network takes them: the official single file (MMDiT + VAE, with or
without the three text encoders inside) and the clip_l / clip_g / t5xxl / vae files, written from
``builtin:tiny-sd3`` in their real layouts and read back with equal weights; our MMDiT writer checked against
diffusers' converter (tiny values, full-size shapes on meta); wrong and missing files as one line; and real engine
runs from the files that train exactly as from the built-in."""

from __future__ import annotations

import pytest
import torch
from fixtures.engine_runs import run_engine, toy_dataset
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import get_family
from sd_scripts_compat.models.build import build_modules
from sd_scripts_compat.models.detect import detect_family
from sd_scripts_compat.models.sd3_files import save_sd3_files, to_sd3
from sd_scripts_compat.network.lora_file import read_lora_file
from sd_scripts_compat.runtimes import load_base_model


@pytest.fixture(scope="module")
def tiny():
    return load_base_model("builtin:tiny-sd3")


def _modules(bundle):
    return [bundle.unet, bundle.vae, *bundle.text_encoders]


def _assert_equal(source, loaded):
    for mine, theirs in zip(_modules(source), _modules(loaded), strict=True):
        want, got = mine.state_dict(), theirs.state_dict()
        assert want.keys() == got.keys(), type(mine).__name__
        assert all(torch.equal(want[k], got[k]) for k in want), type(mine).__name__


@pytest.mark.parametrize("name", ["tiny-sd3", "sd3.5-medium", "sd3.5-large"])
def test_mmdit_writer_inverts_diffusers_converter(name):
    """to_sd3 then diffusers' convert_sd3_transformer_checkpoint_to_diffusers gives back every tensor (values on
    the tiny model, names and shapes on the full-size ones: meta tensors)."""
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    family = get_family(name)
    bundle = build_modules(family, device="cpu" if family.tiny else "meta", seed=0 if family.tiny else None)
    state = bundle.unet.state_dict()
    written = to_sd3(state, family)
    back = convert_sd3_transformer_checkpoint_to_diffusers(dict(written))
    assert back.keys() == state.keys()
    assert all(back[k].shape == state[k].shape for k in state)
    if family.tiny:
        assert all(torch.equal(back[k], state[k]) for k in state)
    # the official file's names (sd3_utils.analyze_state_dict_state reads these)
    assert {"pos_embed", "x_embedder.proj.weight", "y_embedder.mlp.0.weight", "context_embedder.weight",
            "joint_blocks.0.context_block.attn.ln_k.weight", "final_layer.adaLN_modulation.1.weight"} <= written.keys()
    assert ("joint_blocks.0.x_block.attn2.qkv.weight" in written) == (name != "sd3.5-large")


def test_single_file_with_and_without_text_encoders(tmp_path, tiny):
    inside = save_sd3_files(tiny, tmp_path / "inside")
    model = inside["pretrained_model_name_or_path"]
    with safe_open(str(model), "pt") as handle:
        keys = set(handle.keys())
    assert {"model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight",
            "first_stage_model.decoder.up.0.block.0.conv1.weight",
            "text_encoders.clip_l.transformer.text_model.embeddings.token_embedding.weight",
            "text_encoders.clip_g.transformer.text_projection.weight",
            "text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q.weight"} <= keys
    assert detect_family(str(model)).name == "tiny-sd3"
    loaded = load_base_model(model)
    assert loaded.family.name == "tiny-sd3" and loaded.extra["format"] == "sd3_single_file"
    _assert_equal(tiny, loaded)
    split = save_sd3_files(tiny, tmp_path / "split", text_encoders_inside=False, dtype=torch.bfloat16)
    loaded = load_base_model(split["pretrained_model_name_or_path"], dtype=torch.bfloat16,
                             **{k: str(split[k]) for k in ("clip_l", "clip_g", "t5xxl")})
    assert loaded.text_encoders[1].text_projection.weight.dtype == torch.bfloat16
    _assert_equal(build_modules(get_family("tiny-sd3"), dtype=torch.bfloat16), loaded)
    meta = load_base_model(split["pretrained_model_name_or_path"], device="meta")  # header only (traces)
    assert meta.family.name == "tiny-sd3" and next(meta.unet.parameters()).device.type == "meta"


def test_part_files_win_and_clip_l_without_projection(tmp_path, tiny):
    inside = save_sd3_files(tiny, tmp_path / "inside")["pretrained_model_name_or_path"]
    other = build_modules(get_family("tiny-sd3"), seed=None)  # other random weights
    torch.manual_seed(5)
    for module in _modules(other):
        for tensor in module.state_dict().values():
            if tensor.is_floating_point():
                tensor.copy_(torch.randn_like(tensor))
    files = save_sd3_files(other, tmp_path / "other", text_encoders_inside=False)
    clip_l = {k: v for k, v in load_file(str(files["clip_l"])).items() if k != "text_projection.weight"}
    save_file(clip_l, str(tmp_path / "clip_l_no_projection.safetensors"))
    vae_only = {k: v for k, v in load_file(str(files["pretrained_model_name_or_path"])).items()
                if k.startswith("first_stage_model.")}
    save_file(vae_only, str(tmp_path / "sd3_vae.safetensors"))
    loaded = load_base_model(inside, clip_l=str(tmp_path / "clip_l_no_projection.safetensors"),
                             t5xxl=str(files["t5xxl"]), vae=str(tmp_path / "sd3_vae.safetensors"))
    assert torch.equal(loaded.text_encoders[0].text_projection.weight, torch.eye(8))  # as sd-scripts' load_clip_l
    for index, source in ((0, other), (2, other), (1, tiny)):
        want = source.text_encoders[index].state_dict()
        got = loaded.text_encoders[index].state_dict()
        assert all(torch.equal(want[k], got[k]) for k in want if k != "text_projection.weight"), index
    assert all(torch.equal(v, loaded.vae.state_dict()[k]) for k, v in other.vae.state_dict().items())


def test_wrong_and_missing_files_are_one_line(tmp_path, tiny):
    split = save_sd3_files(tiny, tmp_path, text_encoders_inside=False)
    model, clip_l, clip_g, t5xxl = (str(split[k]) for k in ("pretrained_model_name_or_path", "clip_l", "clip_g",
                                                            "t5xxl"))
    cases = [
        ({"clip_l": clip_l},
         r"tiny-sd3.safetensors holds no clip_g, t5xxl; also give clip_g \(clip_g.safetensors\), t5xxl \(t5xxl_fp16"),
        ({"clip_l": clip_g, "clip_g": clip_g, "t5xxl": t5xxl},
         r"clip_g.safetensors is clip_g \(width 16\), not clip_l"),
        ({"clip_l": clip_l, "clip_g": t5xxl, "t5xxl": t5xxl},
         r"t5xxl.safetensors holds a T5 encoder, not what clip_g needs; give clip_g.safetensors as clip_g"),
        ({"clip_l": clip_l, "clip_g": clip_g, "t5xxl": t5xxl, "vae": clip_l},
         r"clip_l.safetensors holds a CLIP text encoder, not what vae needs"),
    ]
    for parts, said in cases:
        with pytest.raises(UserError, match=said) as info:
            load_base_model(model, **parts)
        assert "\n" not in str(info.value)
    tiny.unet.save_pretrained(tmp_path / "diffusers" / "transformer")  # a diffusers SD3 folder
    with pytest.raises(UserError, match="is a folder; sd-scripts' sd3_train_network.py reads SD3 as one file"):
        load_base_model(tmp_path / "diffusers")
    with pytest.raises(UserError, match="is a tiny-flux model, not SD3; clip_g belongs to SD3"):
        load_base_model("builtin:tiny-flux", clip_g=clip_g)


def _config(tmp_path, model, out, **parts):
    from test_sd3_engine import config

    return config(tmp_path, pretrained_model_name_or_path=str(model), output_dir=str(tmp_path / out),
                  cache_latents=True, **parts)


@pytest.mark.slow
def test_engine_trains_from_the_files_exactly_as_from_the_builtin(tmp_path, tiny):
    """The same weights as files (MMDiT + VAE with clip_l / clip_g / t5xxl beside) train to the bit-identical LoRA
    the built-in gives, with sd-scripts' SD3.5 Medium metadata. (Measured by hand too: the one file with the text
    encoders inside gives the same LoRA; its weights load equal to the built-in's in the test above.)"""
    run_engine("sd3_train_network", tmp_path, _config(tmp_path, "builtin:tiny-sd3", "builtin"), name="b.toml")
    split = save_sd3_files(tiny, tmp_path / "split", text_encoders_inside=False)
    run_engine("sd3_train_network", tmp_path, _config(tmp_path, split["pretrained_model_name_or_path"], "split",
                                                      **{k: str(split[k]) for k in ("clip_l", "clip_g", "t5xxl")}),
               name="s.toml")
    want, _ = read_lora_file(tmp_path / "builtin" / "sd3.safetensors")
    for out in ("split",):  # the file with its text encoders inside loads to the same weights (test above)
        got, metadata = read_lora_file(tmp_path / out / "sd3.safetensors")
        assert got.keys() == want.keys() and all(torch.equal(want[k], got[k]) for k in want), out
        assert metadata["ss_base_model_version"] == "5-medium", out
        assert metadata["modelspec.architecture"] == "stable-diffusion-3-5-medium/lora"


def test_sd3_file_given_to_the_sd_script_is_one_line(tmp_path, tiny):
    model = save_sd3_files(tiny, tmp_path / "m")["pretrained_model_name_or_path"]
    values = _config(tmp_path, model, "out", network_module="networks.lora")
    for key in ("t5xxl_max_token_length", "weighting_scheme", "training_shift"):
        values.pop(key)
    result = run_engine("train_network", tmp_path, values, check=False)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "train it with sd_scripts_compat.sd3_train_network" in result.stderr


def _autotune_run(tmp_path, data, model, out, *extra):
    import subprocess
    import sys

    from fixtures.engine_runs import ENV

    command = [sys.executable, "-m", "autotune", "run", str(data), "--model", str(model), "--out", str(out),
               "--epochs", "1", *extra]
    return subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=ENV, timeout=600)


@pytest.mark.slow
def test_autotune_run_trains_sd3_files_with_our_engine(tmp_path, tiny):
    """``autotune run`` on an SD3 single file: with the text encoders inside it needs nothing more; without them
    it names the option (``--clip_g FILE``) before writing anything, and trains once they are given."""
    data = toy_dataset(tmp_path)
    inside = save_sd3_files(tiny, tmp_path / "inside")["pretrained_model_name_or_path"]
    done = _autotune_run(tmp_path, data, inside, tmp_path / "run")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sd3_train_network" in done.stdout and "bottleneck:" in done.stdout
    config = (tmp_path / "run" / "config.toml").read_text(encoding="utf-8")
    assert "clip_g" not in config and "t5xxl =" not in config  # the file holds them
    lora = next(p for p in (tmp_path / "run").glob("*.safetensors") if "-0" not in p.name)
    assert read_lora_file(lora)[1]["modelspec.architecture"] == "stable-diffusion-3-5-medium/lora"

    split = save_sd3_files(tiny, tmp_path / "split", text_encoders_inside=False)
    model = split["pretrained_model_name_or_path"]
    refused = _autotune_run(tmp_path, data, model, tmp_path / "refused", "--clip_l", str(split["clip_l"]))
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "needs its clip_g file" in refused.stderr and "--clip_g FILE" in refused.stderr
    assert not (tmp_path / "refused").exists()
    wrong = _autotune_run(tmp_path, data, model, tmp_path / "wrong", "--gemma2", str(split["clip_l"]))
    assert wrong.returncode == 2 and "takes no gemma2 file; its script takes clip_l, clip_g, t5xxl" in wrong.stderr
    given = _autotune_run(tmp_path, data, model, tmp_path / "given",
                          *(f"--{key}={split[key]}" for key in ("clip_l", "clip_g", "t5xxl")))
    assert given.returncode == 0, given.stderr[-3000:]
    assert f'clip_g = "{split["clip_g"]}"' in (tmp_path / "given" / "config.toml").read_text(encoding="utf-8")


def test_vae_file_replaces_an_sd_models_vae_and_is_refused_for_flux(tmp_path):
    """sd-scripts' ``vae`` option, read by our engine for SD too: an original-layout VAE file (as SD1.5's
    vae-ft-mse ships) or a checkpoint holding one replaces the model's VAE; FLUX.1 names its AE ``ae``."""
    from sd_scripts_compat.models.single_file import original_vae_state, save_single_file

    sd15 = save_single_file(build_modules(get_family("tiny-sd15")), tmp_path / "sd15.safetensors")
    other = build_modules(get_family("tiny-sd15"), seed=None)
    torch.manual_seed(4)
    for tensor in other.vae.state_dict().values():
        tensor.copy_(torch.randn_like(tensor))
    save_file({k: v.contiguous() for k, v in original_vae_state(other.vae).items()}, str(tmp_path / "vae.safetensors"))
    loaded = load_base_model(sd15, vae=str(tmp_path / "vae.safetensors"))
    assert all(torch.equal(v, loaded.vae.state_dict()[k]) for k, v in other.vae.state_dict().items())
    with pytest.raises(UserError, match="takes its autoencoder as ae; rename the key"):
        load_base_model("builtin:tiny-flux", vae=str(tmp_path / "vae.safetensors"))
    with pytest.raises(UserError, match="is a 4-channel VAE; .* needs a 16-channel one"):
        load_base_model(save_sd3_files(load_base_model("builtin:tiny-sd3"), tmp_path / "sd3")[
            "pretrained_model_name_or_path"], vae=str(tmp_path / "vae.safetensors"))
