"""load_base_model: built-in ids, diffusers folders, single files, pickles, and every kind of bad input."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import get_family
from sd_scripts_compat.models.build import build_modules, load_tokenizer
from sd_scripts_compat.models.detect import detect_family
from sd_scripts_compat.models.loading import BUILTIN_IDS
from sd_scripts_compat.models.single_file import original_state_dict, save_single_file
from sd_scripts_compat.runtimes import load_base_model


def _state_equal(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def tiny_sd15_file(tmp_path_factory):
    bundle = build_modules(get_family("tiny-sd15"), seed=7)
    path = save_single_file(bundle, tmp_path_factory.mktemp("models") / "tiny15.safetensors")
    return bundle, path


# ------------------------------------------------------------------------------------------ builtin


def test_builtin_tiny_is_seeded_and_runs():
    a = load_base_model("builtin:tiny-sd15")
    b = load_base_model("builtin:tiny-sd15")
    assert a.family.name == "tiny-sd15" and a.source == "builtin:tiny-sd15"
    assert _state_equal(a.unet, b.unet)
    sample = torch.randn(1, 4, 8, 8)
    context = torch.randn(1, 77, a.unet.config.cross_attention_dim)
    with torch.no_grad():
        out = a.unet(sample, torch.tensor([10]), encoder_hidden_states=context).sample
    assert out.shape == sample.shape


@pytest.mark.parametrize(("name", "unet_params"), [("sd15", 859_520_964), ("sdxl", 2_567_463_684),
                                                   ("sd2", None), ("sd2-v", None)])
def test_builtin_full_size_on_meta(name, unet_params):
    bundle = load_base_model(f"builtin:{name}", device="meta")
    assert next(bundle.unet.parameters()).device.type == "meta"
    if unet_params is not None:
        assert sum(p.numel() for p in bundle.unet.parameters()) == unet_params
    assert bundle.prediction_type == get_family(name).prediction_type
    assert len(bundle.tokenizers) == len(bundle.text_encoders)


def test_unknown_builtin_lists_ids():
    with pytest.raises(UserError) as info:
        load_base_model("builtin:sd3")
    message = str(info.value)
    assert "builtin:sd3" in message and "\n" not in message
    assert all(f"builtin:{name}" in message for name in BUILTIN_IDS)


def test_builtin_with_other_family_is_an_error():
    with pytest.raises(UserError, match="builtin:tiny-sd15 is a tiny-sd15 model but family tiny-sdxl"):
        load_base_model("builtin:tiny-sd15", family=get_family("tiny-sdxl"))


def test_unknown_family_name():
    """A stated name becomes a FamilySpec at the edge (the loaders take the object): an unknown one is one line."""
    with pytest.raises(UserError, match="unknown model family 'sd3'"):
        detect_family("builtin:tiny-sd15", "sd3")


# ------------------------------------------------------------------------------------- diffusers folder


def _write_diffusers_folder(bundle, folder, own_tokenizers=True):
    """save_pretrained of each part plus a model_index.json, as diffusers lays a pipeline out."""
    text_classes = [type(te).__name__ for te in bundle.text_encoders]
    index = {"_class_name": "StableDiffusionXLPipeline" if len(text_classes) == 2 else "StableDiffusionPipeline",
             "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"],
             "scheduler": ["diffusers", "DDPMScheduler"]}
    bundle.unet.save_pretrained(folder / "unet")
    bundle.vae.save_pretrained(folder / "vae")
    for i, te in enumerate(bundle.text_encoders):
        suffix = "" if i == 0 else f"_{i + 1}"
        te.save_pretrained(folder / f"text_encoder{suffix}")
        index[f"text_encoder{suffix}"] = ["transformers", text_classes[i]]
        if own_tokenizers:
            bundle.tokenizers[i].save_pretrained(folder / f"tokenizer{suffix}")
            index[f"tokenizer{suffix}"] = ["transformers", "CLIPTokenizer"]
    (folder / "scheduler").mkdir()
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(bundle.scheduler_config))
    (folder / "model_index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("own_tokenizers", [True, False])
def test_diffusers_folder_round_trip(tmp_path, own_tokenizers):
    source = build_modules(get_family("tiny-sdxl"), seed=11)
    _write_diffusers_folder(source, tmp_path, own_tokenizers=own_tokenizers)
    loaded = load_base_model(str(tmp_path))
    assert loaded.family.name == "tiny-sdxl" and loaded.extra["format"] == "diffusers"
    assert _state_equal(source.unet, loaded.unet) and _state_equal(source.vae, loaded.vae)
    assert all(_state_equal(a, b) for a, b in zip(source.text_encoders, loaded.text_encoders, strict=True))
    assert [type(te).__name__ for te in loaded.text_encoders] == ["CLIPTextModel", "CLIPTextModelWithProjection"]
    assert [t.pad_token for t in loaded.tokenizers] == ["<|endoftext|>", "!"]
    own = [str(tmp_path / "tokenizer"), str(tmp_path / "tokenizer_2")]
    assert loaded.extra["tokenizer_sources"] == (own if own_tokenizers else ["shipped", "shipped"])
    ids = [t("a photo of", padding="max_length", max_length=77)["input_ids"] for t in loaded.tokenizers]
    assert ids[0][:6] == [49406, 320, 1125, 539, 49407, 49407] and ids[1][:6] == [49406, 320, 1125, 539, 49407, 0]
    assert loaded.scheduler_config["prediction_type"] == "epsilon"


def test_diffusers_folder_uses_its_own_tokenizer(tmp_path):
    """A folder whose tokenizer pads differently from the family default keeps its own setting."""
    source = build_modules(get_family("tiny-sd15"), seed=1)
    source.tokenizers[0] = load_tokenizer(pad_token="!")
    _write_diffusers_folder(source, tmp_path)
    loaded = load_base_model(tmp_path)
    assert loaded.tokenizers[0].pad_token == "!"
    assert loaded.tokenizers[0]("a photo of", padding="max_length", max_length=77)["input_ids"][5] == 0


def test_diffusers_folder_family_mismatch(tmp_path):
    _write_diffusers_folder(build_modules(get_family("tiny-sd15")), tmp_path)
    with pytest.raises(UserError, match=f"{tmp_path} is a tiny-sd15 model but family tiny-sdxl was requested"):
        load_base_model(str(tmp_path), family=get_family("tiny-sdxl"))


def test_folder_without_model_index(tmp_path):
    with pytest.raises(UserError, match="without model_index.json"):
        load_base_model(str(tmp_path))


def test_diffusers_folder_with_corrupt_weights(tmp_path):
    _write_diffusers_folder(build_modules(get_family("tiny-sd15")), tmp_path)
    weights = tmp_path / "unet" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(UserError, match=str(tmp_path)):
        load_base_model(str(tmp_path))


# ------------------------------------------------------------------------------------------ single files


def test_single_file_family_mismatch(tiny_sd15_file):
    _, path = tiny_sd15_file
    with pytest.raises(UserError) as info:
        load_base_model(str(path), family=get_family("tiny-sdxl"))
    message = str(info.value)
    assert path.name in message and "tiny-sd15" in message and "tiny-sdxl" in message
    # a stated family that agrees is fine
    assert load_base_model(str(path), family=get_family("tiny-sd15")).family.name == "tiny-sd15"


def test_pickle_needs_flag(tmp_path, tiny_sd15_file):
    bundle, _ = tiny_sd15_file
    path = tmp_path / "model.ckpt"
    torch.save({"state_dict": {k: v.clone() for k, v in original_state_dict(bundle).items()}, "global_step": 5},
               path)
    with pytest.raises(UserError) as info:
        load_base_model(str(path))
    assert "model.ckpt" in str(info.value) and "--allow_pickle" in str(info.value)
    assert "safetensors" in str(info.value)
    loaded = load_base_model(str(path), allow_pickle=True)
    assert loaded.family.name == "tiny-sd15"
    assert _state_equal(bundle.unet, loaded.unet) and _state_equal(bundle.text_encoders[0], loaded.text_encoders[0])


def test_pickle_with_code_is_refused_even_with_flag(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"state_dict": {"x": torch.zeros(1)}, "obj": _Unpicklable()}, path)
    with pytest.raises(UserError, match="evil.pt could not be loaded with torch.load\\(weights_only=True\\)"):
        load_base_model(str(path), allow_pickle=True)


class _Unpicklable:
    """A custom class: weights_only unpickling must refuse it."""


def test_truncated_file(tmp_path, tiny_sd15_file):
    _, path = tiny_sd15_file
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(UserError, match="cut.safetensors is not a readable safetensors file"):
        load_base_model(str(cut))


def test_corrupt_header(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}" + b"\x00" * 64)
    with pytest.raises(UserError, match="bad.safetensors is not a readable safetensors file"):
        load_base_model(str(bad))


def test_text_file_renamed(tmp_path):
    text = tmp_path / "notes.safetensors"
    text.write_text("these are my prompts, not a model\n")
    with pytest.raises(UserError, match="notes.safetensors") as info:
        load_base_model(str(text))
    assert "\n" not in str(info.value)


def test_lora_file_as_base_model(tmp_path):
    lora = tmp_path / "style.safetensors"
    save_file({"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": torch.zeros(4, 32),
               "lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight": torch.zeros(32, 4),
               "lora_unet_down_blocks_0_attentions_0_proj_in.alpha": torch.tensor(4.0)}, str(lora))
    with pytest.raises(UserError, match="style.safetensors is a LoRA file, not a base model"):
        load_base_model(str(lora))


def test_other_tensors_file(tmp_path):
    other = tmp_path / "embedding.safetensors"
    save_file({"emb_params": torch.zeros(2, 768)}, str(other))
    with pytest.raises(UserError, match="embedding.safetensors holds no Stable Diffusion UNet"):
        load_base_model(str(other))


def test_unet_only_file(tmp_path, tiny_sd15_file):
    bundle, _ = tiny_sd15_file
    path = tmp_path / "unet_only.safetensors"
    save_file({k: v.contiguous() for k, v in original_state_dict(bundle).items()
               if k.startswith("model.diffusion_model.")}, str(path))
    with pytest.raises(UserError, match="unet_only.safetensors has a UNet but no known text encoder"):
        load_base_model(str(path))


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match="missing.safetensors not found"):
        load_base_model(str(tmp_path / "missing.safetensors"))


def test_unknown_suffix(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"1234")
    with pytest.raises(UserError, match="model.bin: unknown model file type '.bin'"):
        load_base_model(str(path))
