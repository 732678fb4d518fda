"""FLUX.1 sampling: the shifted Euler schedule and a PNG per prompt from a tiny transformer + 16-channel AE."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from PIL import Image

from sd_scripts_compat.facts.sample_prompts import SamplePrompt, parse_prompt_line
from sd_scripts_compat.runtimes.flux_sampling import flux_schedule, render_flux_samples

SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0,
             "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256,
             "max_image_seq_len": 4096}


def test_schedule_is_shifted_by_the_image_size():
    small = flux_schedule(SCHEDULER, 4, 256)
    large = flux_schedule(SCHEDULER, 4, 4096)
    assert len(small.timesteps) == 4 and small.sigmas[0] == 1.0 and small.sigmas[-1] == 0.0
    assert (large.sigmas[1:4] > small.sigmas[1:4]).all()  # more tokens: noisier steps


def test_prompt_guidance_option():
    sample = parse_prompt_line("a dog --g 2.5 --s 3", SamplePrompt(prompt=""))
    assert sample.prompt == "a dog" and sample.guidance == 2.5 and sample.steps == 3


def test_a_png_per_prompt(tmp_path):
    from diffusers import AutoencoderKL, FluxTransformer2DModel

    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
                                         num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                                         guidance_embeds=True, axes_dims_rope=(4, 6, 6))
    vae = AutoencoderKL(latent_channels=16, block_out_channels=(8, 16, 32, 32), norm_num_groups=4,
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
    family = SimpleNamespace(latent_downsample=8)
    bundle = SimpleNamespace(unet=transformer, vae=vae, family=family, scheduler_config=SCHEDULER)
    calls = []

    def encode(captions):  # the text side is models.text_encoding's; here fixed tensors
        calls.append(captions)
        return torch.ones(1, 4, 32), torch.ones(1, 32), None

    prompts = [SamplePrompt(prompt="a", width=64, height=48, steps=2, seed=1),
               SamplePrompt(prompt="b", width=70, height=64, steps=2, seed=2, guidance=1.0)]
    written = render_flux_samples(bundle, prompts, encode, guidance_scale=3.5, out_dir=tmp_path, name="s",
                                  device="cpu", dtype=torch.float32)
    assert [p.name for p in written] == ["s_00.png", "s_01.png"] and calls == [["a"], ["b"]]
    assert Image.open(written[0]).size == (64, 48) and Image.open(written[1]).size == (64, 64)  # 16 px steps
