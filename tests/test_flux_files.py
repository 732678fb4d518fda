"""FLUX.1 files as sd-scripts takes them: the BFL transformer file, clip_l, t5xxl (bf16 / fp8) and ae written in
their real layouts from the tiny model, read back with equal weights; a diffusers folder; detection from the
header; wrong files as one line. The BFL <-> diffusers table is checked against diffusers' own converter."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import get_family
from sd_scripts_compat.models.build import build_modules
from sd_scripts_compat.models.detect import detect_family
from sd_scripts_compat.models.flux_files import save_flux_files
from sd_scripts_compat.models.flux_layout import to_bfl, to_diffusers
from sd_scripts_compat.models.single_file import save_single_file
from sd_scripts_compat.runtimes import load_base_model


def _parts(bundle):
    return {"transformer": bundle.unet, "ae": bundle.vae, "clip_l": bundle.text_encoders[0],
            "t5xxl": bundle.text_encoders[1]}


def _assert_equal(source, loaded, cast=None):
    for part, module in _parts(source).items():
        theirs = _parts(loaded)[part].state_dict()
        for key, value in module.state_dict().items():
            want = value if cast is None or part != "t5xxl" else value.to(cast).to(value.dtype)
            assert torch.equal(theirs[key], want), (part, key)


@pytest.fixture(scope="module")
def tiny():
    return load_base_model("builtin:tiny-flux")


def test_four_files_round_trip(tmp_path, tiny):
    files = save_flux_files(tiny, tmp_path)
    with safe_open(str(files["pretrained_model_name_or_path"]), "pt") as handle:
        keys = set(handle.keys())
    assert {"double_blocks.0.img_attn.qkv.weight", "single_blocks.1.linear1.weight", "guidance_in.in_layer.weight",
            "final_layer.adaLN_modulation.1.weight", "double_blocks.0.txt_attn.norm.key_norm.scale"} <= keys
    with safe_open(str(files["ae"]), "pt") as handle:
        assert "decoder.up.0.block.0.conv1.weight" in set(handle.keys())
    assert detect_family(str(files["pretrained_model_name_or_path"])).name == "tiny-flux"
    loaded = load_base_model(files["pretrained_model_name_or_path"], clip_l=str(files["clip_l"]),
                             t5xxl=str(files["t5xxl"]), ae=str(files["ae"]))
    assert loaded.family.name == "tiny-flux" and loaded.extra["format"] == "bfl_single_file"
    _assert_equal(tiny, loaded)
    # no T5 tokenizer beside the file: the tiny family's shipped one
    assert loaded.tokenizers[1] is not None and loaded.extra["t5_tokenizer"] is None
    # shapes only (memory traces): the transformer file alone, nothing read but its header
    meta = load_base_model(files["pretrained_model_name_or_path"], device="meta")
    assert meta.family.name == "tiny-flux" and next(meta.unet.parameters()).device.type == "meta"


def test_fp8_t5_and_comfy_prefix(tmp_path, tiny):
    from safetensors.torch import load_file, save_file

    files = save_flux_files(tiny, tmp_path)
    t5 = {k: v.to(torch.float8_e4m3fn) if v.is_floating_point() else v
          for k, v in load_file(str(files["t5xxl"])).items()}
    save_file(t5, str(tmp_path / "t5xxl_fp8_e4m3fn.safetensors"))
    bfl = load_file(str(files["pretrained_model_name_or_path"]))
    transformer = {f"model.diffusion_model.{k}": v for k, v in bfl.items()}  # ComfyUI's prefix
    save_file(transformer, str(tmp_path / "comfy.safetensors"))
    loaded = load_base_model(tmp_path / "comfy.safetensors", clip_l=str(files["clip_l"]), ae=str(files["ae"]),
                             t5xxl=str(tmp_path / "t5xxl_fp8_e4m3fn.safetensors"), dtype=torch.bfloat16)
    assert loaded.text_encoders[1].encoder.block[0].layer[0].SelfAttention.q.weight.dtype == torch.bfloat16
    cast = tiny.text_encoders[1].encoder.block[0].layer[0].SelfAttention.q.weight.to(torch.float8_e4m3fn)
    assert torch.equal(loaded.text_encoders[1].encoder.block[0].layer[0].SelfAttention.q.weight.float(), cast.float())


def test_diffusers_folder_and_tokenizer_beside(tmp_path, tiny):
    from sd_scripts_compat.models.t5_tokenizer import train_unigram_t5_tokenizer

    root = tmp_path / "FLUX.1-tiny"
    tiny.unet.save_pretrained(root / "transformer")
    tiny.vae.save_pretrained(root / "vae")
    tiny.text_encoders[0].save_pretrained(root / "text_encoder")
    tiny.text_encoders[1].save_pretrained(root / "text_encoder_2")
    own = train_unigram_t5_tokenizer(["a red fox jumps", "the quick brown dog"], vocab_size=60, max_length=512)
    own.save_pretrained(str(root / "tokenizer_2"))
    assert detect_family(str(root)).name == "tiny-flux"
    loaded = load_base_model(root)
    assert loaded.extra["format"] == "diffusers" and loaded.extra["t5_tokenizer"] == str(root / "tokenizer_2")
    assert loaded.tokenizers[1]("a red fox").input_ids == own("a red fox").input_ids
    _assert_equal(tiny, loaded)
    # a lone transformer folder plus the part files
    files = save_flux_files(tiny, tmp_path / "files")
    alone = load_base_model(root / "transformer", clip_l=str(files["clip_l"]), t5xxl=str(files["t5xxl"]),
                            ae=str(files["ae"]))
    _assert_equal(tiny, alone)


def test_wrong_and_missing_files_are_one_line(tmp_path, tiny):
    files = save_flux_files(tiny, tmp_path)
    sd = save_single_file(build_modules(get_family("tiny-sd15")), tmp_path / "sd15.safetensors")
    transformer, clip_l, t5xxl, ae = (str(files[k]) for k in ("pretrained_model_name_or_path", "clip_l", "t5xxl",
                                                               "ae"))
    with pytest.raises(UserError, match=r"sd15.safetensors holds a Stable Diffusion checkpoint, not what ae needs; "
                                        r"give ae.safetensors .* as ae") as info:
        load_base_model(transformer, clip_l=clip_l, t5xxl=t5xxl, ae=str(sd))
    assert "\n" not in str(info.value)
    with pytest.raises(UserError, match=r"holds a T5-XXL encoder \(t5xxl\), not what clip_l needs"):
        load_base_model(transformer, clip_l=t5xxl, t5xxl=t5xxl, ae=ae)
    with pytest.raises(UserError, match=r"is a FLUX transformer file without text encoders or AE; also give t5xxl, ae"):
        load_base_model(transformer, clip_l=clip_l)
    with pytest.raises(UserError, match="is a tiny-sd15 model, not FLUX.1"):
        load_base_model(sd, ae=ae)
    sd_vae = tmp_path / "sd_vae.safetensors"  # an SD VAE file in the original layout: 4 latent channels
    from safetensors.torch import load_file, save_file

    save_file({k.removeprefix("first_stage_model."): v for k, v in load_file(str(sd)).items()
               if k.startswith("first_stage_model.")}, str(sd_vae))
    with pytest.raises(UserError, match="sd_vae.safetensors is a 4-channel VAE, not FLUX.1's 16-channel AE"):
        load_base_model(transformer, clip_l=clip_l, t5xxl=t5xxl, ae=str(sd_vae))
    # a diffusers-named AE file (vae/diffusion_pytorch_model.safetensors) is taken as it is
    save_file({k: v.contiguous() for k, v in tiny.vae.state_dict().items()}, str(tmp_path / "ae_diffusers.safetensors"))
    loaded = load_base_model(transformer, clip_l=clip_l, t5xxl=t5xxl, ae=str(tmp_path / "ae_diffusers.safetensors"))
    assert all(torch.equal(loaded.vae.state_dict()[k], v) for k, v in tiny.vae.state_dict().items())


def test_header_detection_tells_dev_from_schnell_on_meta():
    """Full-size BFL headers (meta tensors: no bytes) are told apart by the guidance embedder."""
    for name in ("flux-dev", "flux-schnell"):
        bundle = build_modules(get_family(name), device="meta", seed=None)
        shapes = {k: tuple(v.shape) for k, v in to_bfl(bundle.unet.state_dict(), bundle.unet.config).items()}
        from sd_scripts_compat.models.detect import all_families, checkpoint_candidates

        assert [f.name for f in checkpoint_candidates(shapes, "flux", all_families())] == [name]


def test_layout_table_agrees_with_diffusers_converter_at_full_size():
    """Our BFL -> diffusers split equals diffusers' convert_flux_transformer_checkpoint_to_diffusers on FLUX.1-dev's
    real row counts (each tensor one column wide: the converters only move rows)."""
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    bundle = build_modules(get_family("flux-dev"), device="meta", seed=None)
    config = bundle.unet.config
    meta_bfl = to_bfl(bundle.unet.state_dict(), config)
    gen = torch.Generator().manual_seed(0)
    thin = {k: torch.randn((v.shape[0],) + ((1,) if v.dim() > 1 else ()), generator=gen) for k, v in meta_bfl.items()}
    ours = to_diffusers(thin, config)
    theirs = convert_flux_transformer_checkpoint_to_diffusers(dict(thin))
    assert set(ours) == set(theirs) == set(bundle.unet.state_dict())
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert all(ours[k].shape[0] == v.shape[0] for k, v in bundle.unet.state_dict().items())
    back = to_bfl(ours, config)
    assert all(torch.equal(back[k], thin[k]) for k in thin)


def test_chroma_files_round_trip_without_clip_l(tmp_path):
    """tiny-chroma written as sd-scripts' Chroma files (BFL transformer with the approximator, t5xxl, ae; no
    clip_l) is told from FLUX.1 by its header and loads back bit for bit; clip_l is not asked for."""
    chroma = load_base_model("builtin:tiny-chroma")
    files = save_flux_files(chroma, tmp_path)
    assert "clip_l" not in files
    with safe_open(str(files["pretrained_model_name_or_path"]), "pt") as handle:
        keys = set(handle.keys())
    assert {"distilled_guidance_layer.layers.0.in_layer.weight", "distilled_guidance_layer.norms.0.scale",
            "double_blocks.0.img_attn.qkv.weight", "single_blocks.1.linear1.weight",
            "final_layer.linear.weight"} <= keys
    assert not any("_mod." in k or "modulation" in k or k.startswith(("guidance_in", "vector_in")) for k in keys)
    assert detect_family(str(files["pretrained_model_name_or_path"])).name == "tiny-chroma"
    loaded = load_base_model(files["pretrained_model_name_or_path"], t5xxl=str(files["t5xxl"]), ae=str(files["ae"]))
    assert loaded.family.name == "tiny-chroma"
    for mine, theirs in ((chroma.unet, loaded.unet), (chroma.vae, loaded.vae),
                         (chroma.text_encoders[0], loaded.text_encoders[0])):
        other = theirs.state_dict()
        assert all(torch.equal(other[k], v) for k, v in mine.state_dict().items())


def test_chroma_layout_agrees_with_diffusers_converter_at_full_size():
    """Our BFL -> diffusers names for Chroma equal diffusers' convert_chroma_transformer_checkpoint_to_diffusers
    on the full-size model's row counts, and the way back restores every tensor."""
    from diffusers.loaders.single_file_utils import convert_chroma_transformer_checkpoint_to_diffusers

    bundle = build_modules(get_family("chroma"), device="meta", seed=None)
    config = bundle.unet.config
    gen = torch.Generator().manual_seed(0)
    thin = {k: torch.randn((v.shape[0],) + ((1,) if v.dim() > 1 else ()), generator=gen)
            for k, v in to_bfl(bundle.unet.state_dict(), config).items()}
    ours = to_diffusers(thin, config)
    theirs = convert_chroma_transformer_checkpoint_to_diffusers(dict(thin))
    assert set(ours) == set(theirs) == set(bundle.unet.state_dict())
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    back = to_bfl(ours, config)
    assert all(torch.equal(back[k], thin[k]) for k in thin)


def test_the_parts_beside_a_model_are_told_apart_by_their_headers(tmp_path, tiny):
    """The web page fills clip_l / t5xxl / ae from the files beside a FLUX.1 file (``models.part_kind``): by the
    keys and widths in their headers, not their names; two files of one kind (fp16 and fp8 T5) leave it to the user;
    a file that is no safetensors is passed over."""
    import shutil

    from sd_scripts_compat.models.part_kind import part_kind, parts_beside

    files = save_flux_files(tiny, tmp_path / "models")
    renamed = {key: files[key].rename(tmp_path / "models" / f"part{i}.safetensors")
               for i, key in enumerate(("clip_l", "t5xxl", "ae"))}
    (tmp_path / "models" / "notes.safetensors").write_text("not a checkpoint")
    model = files["pretrained_model_name_or_path"]
    assert parts_beside(model, ["clip_l", "t5xxl", "ae"]) == renamed
    assert parts_beside(model, ["clip_l", "clip_g"]) == {}  # a CLIP of a tiny width: its name says neither
    shutil.copy(renamed["t5xxl"], tmp_path / "models" / "t5xxl_fp8.safetensors")
    assert parts_beside(model, ["clip_l", "t5xxl", "ae"]) == {"clip_l": renamed["clip_l"], "ae": renamed["ae"]}
    token = "text_model.embeddings.token_embedding.weight"
    assert part_kind({token: (49408, 768)}) == "clip_l" and part_kind({token: (49408, 1280)}) == "clip_g"
    assert part_kind({"decoder.conv_out.weight": (3, 128, 3, 3)}) == "autoencoder"
    assert part_kind({"decoder.head.2.weight": (3, 96, 3, 3, 3)}) == "autoencoder"  # Wan / Qwen-Image's 3D VAE
    assert part_kind({"model.embed_tokens.weight": (151936, 3584)}) == "llm"  # Qwen2.5-VL, Qwen3, Gemma 2
    assert part_kind({"encoder.block.0.layer.0.SelfAttention.q.weight": (64, 64)}) == "t5"
    assert part_kind({"double_blocks.0.img_attn.qkv.weight": (9, 3)}) is None  # a transformer: no part
    assert part_kind({"first_stage_model.decoder.conv_out.weight": (3, 128, 3, 3)}) is None  # a whole checkpoint


def test_the_files_beside_a_musubi_or_sd_scripts_dit_are_told_apart_the_same_way(tmp_path):
    """musubi-tuner's Qwen-Image (a VAE in ComfyUI's 3D layout, the Qwen2.5-VL text encoder) and sd-scripts'
    HunyuanImage-2.1 (a language model, a ByT5 encoder, a VAE): each file found for its option by the keys its
    loader reads (headers written with small tensors of those names); a .pth beside them is not read."""
    from safetensors.torch import save_file

    from sd_scripts_compat.models.part_kind import parts_beside

    def part(name: str, *keys: str):  # -> the file written
        path = tmp_path / name
        save_file({key: torch.zeros(2, 2) for key in keys}, str(path))
        return path

    dit = part("qwen_image_bf16.safetensors", "transformer_blocks.0.attn.to_q.weight")
    vae = part("qwen_image_vae.safetensors", "decoder.head.2.weight", "encoder.conv1.weight")
    llm = part("qwen_2.5_vl_7b.safetensors", "model.embed_tokens.weight", "visual.blocks.0.attn.qkv.weight")
    (tmp_path / "models_t5_umt5-xxl-enc-bf16.pth").write_bytes(b"a pickle: never read")
    assert parts_beside(dit, ["vae", "text_encoder"]) == {"vae": vae, "text_encoder": llm}
    byt5 = part("byt5_small_glyphxl_fp16.safetensors", "encoder.block.0.layer.0.SelfAttention.q.weight")
    assert parts_beside(dit, ["text_encoder", "byt5", "vae"]) == {"text_encoder": llm, "byt5": byt5, "vae": vae}
    # Wan 2.2: its T5 (a .pth, found by name, never opened) and the high-noise expert (a second DiT) beside the
    # low-noise one
    wan = tmp_path / "wan"
    wan.mkdir()
    low = wan / "wan2.2_t2v_low_noise_14B_fp16.safetensors"
    high = wan / "wan2.2_t2v_high_noise_14B_fp16.safetensors"
    for path in (low, high):
        save_file({"blocks.0.self_attn.q.weight": torch.zeros(2, 2)}, str(path))
    t5 = wan / "models_t5_umt5-xxl-enc-bf16.pth"
    t5.write_bytes(b"a pickle: never opened")
    save_file({"decoder.head.2.weight": torch.zeros(2, 2)}, str(wan / "wan_2.1_vae.safetensors"))
    assert parts_beside(low, ["vae", "t5", "dit_high_noise"]) == {"vae": wan / "wan_2.1_vae.safetensors", "t5": t5,
                                                                 "dit_high_noise": high}
