"""A musubi-tuner family told from its own single file: the DiT checkpoints musubi loads (Qwen-Image's and Z-Image's
Comfy-Org files, BFL's FLUX.2 files, Wan's original ones) carry their model's module names, read from the header
alone. Written here as small safetensors files with those names and block counts (the weights cannot exist here:
tens of GB each); the names are musubi-tuner's model attributes (``qwen_image_model``, ``flux2_models``,
``wan/modules/model``, ``zimage_model``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from autotune.planning.planner import PlanRequest, gpu_from_vram, plan_training
from autotune.planning.toml_writer import write_plan_files
from sd_scripts_compat.models.detect import detect_family

# family -> (module names outside the blocks, {block list: count})
FILES = {
    "qwen-image": (("img_in", "txt_in", "txt_norm", "time_text_embed.timestep_embedder.linear_1", "proj_out"),
                   {"transformer_blocks": 60}),
    "flux2-dev": (("img_in", "txt_in", "time_in.in_layer", "guidance_in.in_layer", "double_stream_modulation_img.lin",
                   "double_stream_modulation_txt.lin", "single_stream_modulation.lin", "final_layer.linear"),
                  {"double_blocks": 8, "single_blocks": 48}),
    "flux2-klein-4b": (("img_in", "txt_in", "time_in.in_layer", "double_stream_modulation_img.lin",
                        "double_stream_modulation_txt.lin", "single_stream_modulation.lin", "final_layer.linear"),
                       {"double_blocks": 5, "single_blocks": 20}),
    "flux2-klein-9b": (("img_in", "txt_in", "time_in.in_layer", "double_stream_modulation_img.lin",
                        "double_stream_modulation_txt.lin", "single_stream_modulation.lin", "final_layer.linear"),
                       {"double_blocks": 8, "single_blocks": 24}),
    "wan2.1-t2v-1.3b": (("patch_embedding", "text_embedding.0", "time_embedding.0", "time_projection.1", "head.head"),
                        {"blocks": 30}),
    "wan2.2-t2v-a14b": (("patch_embedding", "text_embedding.0", "time_embedding.0", "time_projection.1", "head.head"),
                        {"blocks": 40}),
    "z-image": (("all_x_embedder.2-1", "cap_embedder.1", "t_embedder.mlp.0", "noise_refiner.0.attention.qkv",
                 "context_refiner.0.attention.qkv"), {"layers": 30}),
}


def write_dit(path: Path, family: str, prefix: str = "") -> Path:
    outside, lists = FILES[family]
    names = list(outside) + [f"{name}.{i}.proj" for name, count in lists.items() for i in range(count)]
    save_file({f"{prefix}{name}.weight": torch.zeros(2, 2, dtype=torch.bfloat16) for name in names}, str(path))
    return path


@pytest.mark.parametrize("family", list(FILES))
def test_a_musubi_dit_file_is_told_by_its_header(tmp_path: Path, family: str) -> None:
    assert detect_family(write_dit(tmp_path / "dit.safetensors", family)).name == family
    # ComfyUI's prefix, as its repackaged files may carry it
    assert detect_family(write_dit(tmp_path / "comfy.safetensors", family, "model.diffusion_model.")).name == family


def test_a_plan_from_the_file_names_it_in_the_script(tmp_path: Path) -> None:
    dit = write_dit(tmp_path / "z_image_bf16.safetensors", "z-image")
    plan = plan_training(PlanRequest(dataset_dir=None, model=str(dit), gpus=(gpu_from_vram(16),),
                                     cpu_physical_cores=8))
    assert plan.family.name == "z-image" and plan.fits
    write_plan_files(plan, tmp_path / "out")
    assert f': "${{DIT:={dit.resolve()}}}"' in (tmp_path / "out" / "musubi_train.sh").read_text()
