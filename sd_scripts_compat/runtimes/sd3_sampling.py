"""SD3 / SD3.5 sample images during training, as sd-scripts' ``sd3_train_utils.do_sample`` draws them.

Hand-written (one line why): diffusers' StableDiffusion3Pipeline re-encodes prompts its own way (no kohya masks,
its own T5 length) and schedules sigmas differently, so its images would not be sd-scripts' images.
sd-scripts' sampler: ``ModelSamplingDiscreteFlow(shift=3.0)``; timesteps linear from 1000 * sigma_max to
1000 * sigma_min, each made a sigma by the shift, then 0; noise from ``torch.manual_seed(seed)`` on the CPU in
fp32; classifier-free guidance with the prompt's ``--l`` (default 7.5) against ``--n`` (default ""); Euler steps
``x += v * (sigma_next - sigma)`` (its denoised-space guidance is the same line in velocity). Sizes are whole
2x2 latent patches (16 px; sd-scripts rounds to 8 and lets its MMDiT pad).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import PIL.Image
    import torch

    from sd_scripts_compat.facts.sample_prompts import SamplePrompt
    from sd_scripts_compat.models.build import ModelBundle
    from sd_scripts_compat.runtimes import Encode

SAMPLE_SHIFT = 3.0  # sd-scripts: "3.0 is for SD3"
TIMESTEPS = 1000


def _shifted(t: torch.Tensor, shift: float) -> torch.Tensor:
    t = t / TIMESTEPS
    return t if shift == 1.0 else shift * t / (1 + (shift - 1) * t)


def sd3_sigmas(steps: int, shift: float = SAMPLE_SHIFT) -> torch.Tensor:
    """``steps`` sigmas from 1 down, then 0 (sd3_train_utils.get_all_sigmas)."""
    import torch

    sigma_min, sigma_max = (float(_shifted(torch.tensor(t, dtype=torch.float32), shift)) for t in (1.0, TIMESTEPS))
    timesteps = torch.linspace(sigma_max * TIMESTEPS, sigma_min * TIMESTEPS, steps)
    return torch.cat([_shifted(timesteps, shift), torch.zeros(1)])


def render_sd3_sample(bundle: ModelBundle, encode: Encode, sample: SamplePrompt, *, width: int, height: int, seed: int,
                      device: str | torch.device, dtype: torch.dtype) -> PIL.Image.Image:
    """One image (a PIL image). ``encode(captions)`` gives a ``TextConditioning`` (hidden states, pooled)."""
    import torch
    from PIL import Image

    vae, transformer = bundle.vae, bundle.unet
    scale = bundle.family.latent_downsample
    shape = (1, vae.config.latent_channels, height // scale, width // scale)
    x = torch.randn(shape, dtype=torch.float32, generator=torch.Generator("cpu").manual_seed(seed)).to(device, dtype)
    positive, negative = encode([sample.prompt]), encode([sample.negative_prompt or ""])
    hidden = torch.cat([positive.encoder_hidden_states, negative.encoder_hidden_states]).to(device, dtype)
    assert positive.pooled is not None and negative.pooled is not None  # SD3's CLIP-L and -G always pool
    pooled = torch.cat([positive.pooled, negative.pooled]).to(device, dtype)
    sigmas = sd3_sigmas(sample.steps).to(device)
    for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
        timestep = (sigma * TIMESTEPS).expand(2).to(dtype)
        velocity = transformer(hidden_states=torch.cat([x, x]), encoder_hidden_states=hidden,
                               pooled_projections=pooled, timestep=timestep, return_dict=False)[0].float()
        conditional, unconditional = velocity.chunk(2)
        guided = unconditional + (conditional - unconditional) * sample.guidance_scale
        x = (x.float() + guided * (sigma_next - sigma)).to(dtype)
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    parameter = next(vae.parameters())
    decoded = vae.decode((x / vae.config.scaling_factor + shift).to(parameter.device, parameter.dtype)).sample
    pixels = ((decoded[0].float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    return Image.fromarray(pixels)


def render_sd3_samples(bundle: ModelBundle, prompts: list[Any], encode: Encode, *, out_dir: Path, name: str,
                       device: str | torch.device, dtype: torch.dtype) -> list[Path]:
    """Render each ``SamplePrompt`` to ``out_dir/{name}_{index:02d}.png`` (written atomically)."""
    from sd_scripts_compat.runtimes.sample_files import write_each

    def render(sample: SamplePrompt, width: int, height: int, seed: int) -> PIL.Image.Image:
        return render_sd3_sample(bundle, encode, sample, width=width, height=height, seed=seed, device=device,
                                 dtype=dtype)

    return write_each(prompts, render, step=bundle.family.latent_downsample * 2, out_dir=out_dir, name=name,
                      device=device, dtype=dtype)  # whole 2x2 patches
