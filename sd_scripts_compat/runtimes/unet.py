"""The UNet runtime: SD 1.x, SD 2.x and SDXL (kohya's ``train_network.py`` / ``sdxl_train_network.py``).

Loads built-ins, diffusers folders and original-layout single files (``models.loading``); encodes captions
with the CLIP encoders by sd-scripts' long-prompt rules; trains DDPM noise (or v) prediction
(``noise_prediction``); conditions SDXL on its size ids; samples with diffusers' pipelines.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import PIL.Image
    import torch
    from diffusers import DiffusionPipeline

    from sd_scripts_compat.config.training_config import TrainingConfig
    from sd_scripts_compat.facts.families import FamilySpec
    from sd_scripts_compat.facts.sample_prompts import SamplePrompt
    from sd_scripts_compat.models.build import ModelBundle
    from sd_scripts_compat.models.text_encoding import TextConditioning
    from sd_scripts_compat.runtimes import Encode, Objective, TextOptions

LOAD_PRIORITY = 100  # asked last: it loads every source the others leave

SAMPLERS = {
    "ddim": "DDIMScheduler", "pndm": "PNDMScheduler", "euler": "EulerDiscreteScheduler",
    "k_euler": "EulerDiscreteScheduler", "euler_a": "EulerAncestralDiscreteScheduler",
    "k_euler_a": "EulerAncestralDiscreteScheduler", "heun": "HeunDiscreteScheduler",
    "dpm_2": "KDPM2DiscreteScheduler", "k_dpm_2": "KDPM2DiscreteScheduler",
    "dpm_2_a": "KDPM2AncestralDiscreteScheduler", "k_dpm_2_a": "KDPM2AncestralDiscreteScheduler",
    "dpmsolver": "DPMSolverMultistepScheduler", "dpmsolver++": "DPMSolverMultistepScheduler",
    "dpmsingle": "DPMSolverSinglestepScheduler",
}


def claims_source(text: str, stated: FamilySpec | None, parts: Mapping[str, str | None]) -> bool:
    return True


def load(text: str, *, stated: FamilySpec | None, parts: Mapping[str, str | None], allow_pickle: bool,
         device: str | torch.device, dtype: torch.dtype | None, vae_dtype: torch.dtype | None) -> ModelBundle:
    """A built-in, a diffusers folder or a single file; kohya's ``vae`` replaces its VAE."""
    from sd_scripts_compat.models.loading import load_sd_model, replace_vae

    bundle = load_sd_model(text, family=stated, allow_pickle=allow_pickle, device=device, dtype=dtype,
                           vae_dtype=vae_dtype)
    return replace_vae(bundle, parts.get("vae"), device=device, dtype=vae_dtype or dtype)


def encode_prompts(bundle: ModelBundle, captions: list[str], options: TextOptions) -> TextConditioning:
    from sd_scripts_compat.models.text_encoding import encode_clip_prompts

    return encode_clip_prompts(bundle, captions, max_token_length=options.max_token_length,
                               clip_skip=options.clip_skip, dtype=options.dtype)


def text_cache_key(options: TextOptions) -> tuple[int | None, str]:
    from sd_scripts_compat.models.text_encoding import check_max_token_length

    return check_max_token_length(options.max_token_length), ""


def conditioning(bundle: ModelBundle, hidden: torch.Tensor, pooled: torch.Tensor | None,
                 mask: torch.Tensor | None, batch: Mapping[str, Any], options: TextOptions) -> tuple[Any, Any]:
    """SD 1.x/2.x: the hidden states alone; SDXL: its pooled text embedding and size ids as well."""
    from sd_scripts_compat.models.text_encoding import sdxl_time_ids

    if not bundle.family.is_sdxl:
        return hidden, None
    assert pooled is not None, "SDXL's second text encoder gives the pooled embedding"
    time_ids = sdxl_time_ids(batch["original_sizes_hw"], batch["crop_top_lefts"], batch["target_sizes_hw"],
                             dtype=options.dtype).to(hidden.device)
    return hidden, {"text_embeds": pooled.to(hidden.device, options.dtype), "time_ids": time_ids}


def build_objective(config: TrainingConfig, device: torch.device, bundle: ModelBundle,
                    v_parameterization: bool) -> Objective:
    """DDPM noise prediction (epsilon or v) with kohya's noise offset, timestep range and min-SNR weighting."""
    from diffusers import DDPMScheduler

    from sd_scripts_compat.runtimes.noise_prediction import NoisePredictionObjective, NoiseSettings

    noise_scheduler = DDPMScheduler.from_config(bundle.scheduler_config)
    noise = NoiseSettings(noise_offset=config.noise_offset, min_timestep=config.min_timestep or 0,
                          max_timestep=1000 if config.max_timestep is None else config.max_timestep,  # 0 is 0
                          v_parameterization=v_parameterization, min_snr_gamma=config.min_snr_gamma)
    return NoisePredictionObjective(noise_scheduler, noise_scheduler.alphas_cumprod.to(device), noise)


def build_pipeline(bundle: ModelBundle, sampler: str) -> DiffusionPipeline:
    import diffusers

    scheduler_class = getattr(diffusers, SAMPLERS.get(sampler.lower(), "DDIMScheduler"))
    scheduler = scheduler_class.from_config(bundle.scheduler_config)
    if bundle.family.is_sdxl:
        return diffusers.StableDiffusionXLPipeline(
            vae=bundle.vae, text_encoder=bundle.text_encoders[0], text_encoder_2=bundle.text_encoders[1],
            tokenizer=bundle.tokenizers[0], tokenizer_2=bundle.tokenizers[1], unet=bundle.unet, scheduler=scheduler)
    return diffusers.StableDiffusionPipeline(
        vae=bundle.vae, text_encoder=bundle.text_encoders[0], tokenizer=bundle.tokenizers[0], unet=bundle.unet,
        scheduler=scheduler, safety_checker=None, feature_extractor=None, requires_safety_checker=False)


def render_samples(bundle: ModelBundle, prompts: list[Any], encode: Encode, *, config: TrainingConfig,
                   out_dir: Path, name: str, device: torch.device, dtype: torch.dtype) -> list[Path]:
    """Each prompt through diffusers' pipeline (the config's ``sample_sampler``, default DDIM) to
    ``out_dir/{name}_{index:02d}.png`` (written atomically); the pipeline encodes its own prompts."""
    return render_with_pipeline(bundle, prompts, sampler=config.sample_sampler or "ddim", out_dir=out_dir,
                                name=name, device=device, dtype=dtype, clip_skip=config.clip_skip)


def render_with_pipeline(bundle: ModelBundle, prompts: list[Any], *, sampler: str, out_dir: Path, name: str,
                         device: str | torch.device, dtype: torch.dtype, clip_skip: int | None = None) -> list[Path]:
    """Render each prompt to ``out_dir/{name}_{index:02d}.png`` (written atomically)."""
    import torch

    from sd_scripts_compat.runtimes.sample_files import write_each

    pipeline = build_pipeline(bundle, sampler)
    pipeline.set_progress_bar_config(disable=True)
    extra = {"clip_skip": clip_skip - 1} if clip_skip and clip_skip > 1 and not bundle.family.is_sdxl else {}

    def render(sample: SamplePrompt, width: int, height: int, seed: int) -> PIL.Image.Image:
        return pipeline(prompt=sample.prompt, negative_prompt=sample.negative_prompt or None, width=width,
                        height=height, num_inference_steps=sample.steps, guidance_scale=sample.guidance_scale,
                        generator=torch.Generator(device="cpu").manual_seed(seed), **extra).images[0]

    return write_each(prompts, render, step=8, out_dir=out_dir, name=name, device=device, dtype=dtype)


def file_metadata(config: TrainingConfig) -> dict[str, str]:
    return {}
