"""FLUX.1 sample images during training: flow-matching Euler steps with the guidance embedding.

As FLUX's own sampler (and diffusers' FluxPipeline, which needs tokenizers and encoders as a pipeline
expects them, so it is not used here): sigmas from 1 to 1/steps, shifted for the image's token count
(mu from 256 tokens 0.5 to 4096 tokens 1.15) by diffusers' ``FlowMatchEulerDiscreteScheduler``; each step
``x += (sigma_next - sigma) * v``. The prompt's ``--g`` (or the config's ``guidance_scale``) feeds the
guidance embedding of dev; schnell has none. No classifier-free guidance (sd-scripts' ``--l`` default 1.0).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    import PIL.Image
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler

    from sd_scripts_compat.facts.sample_prompts import SamplePrompt
    from sd_scripts_compat.models.build import ModelBundle

    # captions -> (T5 hidden states, pooled CLIP-L, T5 mask or None)
    FluxEncode = Callable[[list[str]], tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]


def flux_schedule(scheduler_config: dict[str, Any], steps: int, image_tokens: int) -> FlowMatchEulerDiscreteScheduler:
    """The scheduler, set to ``steps`` shifted sigmas for an image of ``image_tokens`` packed tokens."""
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler

    from sd_scripts_compat.runtimes.flow_matching import flux_mu

    config = {k: v for k, v in scheduler_config.items() if not k.startswith("_")}
    scheduler = FlowMatchEulerDiscreteScheduler(**config)
    sigmas = np.linspace(1.0, 1.0 / steps, steps)
    if scheduler.config.use_dynamic_shifting:
        scheduler.set_timesteps(sigmas=sigmas, mu=flux_mu(image_tokens))
    else:
        scheduler.set_timesteps(sigmas=sigmas)
    return scheduler


def render_flux_sample(bundle: ModelBundle, encode: FluxEncode, prompt: str, *, width: int, height: int, steps: int,
                       guidance: float, seed: int, device: str | torch.device, dtype: torch.dtype) -> PIL.Image.Image:
    """One image (a PIL image). ``encode(captions) -> (t5_hidden, pooled, t5_mask or None)``."""
    import torch

    from sd_scripts_compat.runtimes.flow_matching import flux_prediction

    vae, transformer = bundle.vae, bundle.unet
    scale = bundle.family.latent_downsample
    channels = vae.config.latent_channels
    generator = torch.Generator(device="cpu").manual_seed(seed)
    latents = torch.randn((1, channels, height // scale, width // scale), generator=generator).to(device, dtype)
    t5_hidden, pooled, mask = encode([prompt])
    scheduler = flux_schedule(bundle.scheduler_config, steps, (height // scale // 2) * (width // scale // 2))
    for t in scheduler.timesteps:
        timestep = t.expand(latents.shape[0]).to(device)
        velocity = flux_prediction(transformer, latents, timestep, t5_hidden.to(device, dtype),
                                   None if pooled is None else pooled.to(device, dtype), mask, guidance)
        latents = scheduler.step(velocity, t, latents, return_dict=False)[0]
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    parameter = next(vae.parameters())
    decoded = vae.decode((latents / vae.config.scaling_factor + shift).to(parameter.device, parameter.dtype)).sample
    pixels = ((decoded[0].float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    from PIL import Image

    return Image.fromarray(pixels)


def render_flux_samples(bundle: ModelBundle, prompts: list[Any], encode: FluxEncode, *, guidance_scale: float,
                        out_dir: Path, name: str, device: str | torch.device, dtype: torch.dtype) -> list[Path]:
    """Render each ``SamplePrompt`` to ``out_dir/{name}_{index:02d}.png`` (written atomically)."""
    from sd_scripts_compat.runtimes.sample_files import write_each

    def render(sample: SamplePrompt, width: int, height: int, seed: int) -> PIL.Image.Image:
        guidance = sample.guidance if sample.guidance is not None else guidance_scale
        return render_flux_sample(bundle, encode, sample.prompt, width=width, height=height, steps=sample.steps,
                                  guidance=guidance, seed=seed, device=device, dtype=dtype)

    return write_each(prompts, render, step=bundle.family.latent_downsample * 2, out_dir=out_dir, name=name,
                      device=device, dtype=dtype)  # whole 2x2 tokens
