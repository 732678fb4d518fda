"""The diffusion training objective as sd-scripts defines it: noise, timesteps, target and loss.

Plain tensor functions, no state: the loop passes a per-step ``torch.Generator``
(``training.train_state.step_generator``) so the noise of step N is the same whether the run went straight
through or was resumed at step N. The UNet runtime's objective (``runtimes.unet``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


class NoiseScheduler(Protocol):
    """What the objective calls on diffusers' ``DDPMScheduler`` (mypy cannot read diffusers' lazy classes)."""

    alphas_cumprod: torch.Tensor

    def add_noise(self, original_samples: torch.Tensor, noise: torch.Tensor,
                  timesteps: torch.Tensor) -> torch.Tensor: ...

    def get_velocity(self, sample: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class NoiseSettings:
    noise_offset: float | None = None
    min_timestep: int = 0
    max_timestep: int = 1000
    v_parameterization: bool = False
    min_snr_gamma: float | None = None


def sample_noise_and_timesteps(latents: torch.Tensor, settings: NoiseSettings,
                               generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    batch, channels = latents.shape[:2]
    noise = torch.randn(latents.shape, generator=generator, device=latents.device, dtype=latents.dtype)
    if settings.noise_offset:
        # sd-scripts: a per-sample, per-channel constant shifts the mean so very dark/bright images can be learnt
        offset = torch.randn((batch, channels, 1, 1), generator=generator, device=latents.device, dtype=latents.dtype)
        noise = noise + settings.noise_offset * offset
    if settings.min_timestep < settings.max_timestep:
        timesteps = torch.randint(settings.min_timestep, settings.max_timestep, (batch,), generator=generator,
                                  device=latents.device).long()
    else:  # sd-scripts' get_timesteps: equal bounds train every sample at that timestep
        timesteps = torch.full((batch,), settings.max_timestep, device=latents.device, dtype=torch.long)
    return noise, timesteps


def diffusion_target(noise_scheduler: NoiseScheduler, latents: torch.Tensor, noise: torch.Tensor,
                     timesteps: torch.Tensor, v_parameterization: bool) -> torch.Tensor:
    if v_parameterization:
        return noise_scheduler.get_velocity(latents, noise, timesteps)
    return noise


def per_sample_loss(prediction: torch.Tensor, target: torch.Tensor, timesteps: torch.Tensor,
                    loss_weights: torch.Tensor, alphas_cumprod: torch.Tensor, settings: NoiseSettings) -> torch.Tensor:
    """MSE per sample in fp32, times the sample's loss weight (prior_loss_weight for regularisation
    images) and, with ``min_snr_gamma``, the Min-SNR weight (Hang et al. 2023) as sd-scripts applies it."""
    import torch.nn.functional as F

    loss = F.mse_loss(prediction.float(), target.float(), reduction="none").mean(dim=(1, 2, 3))
    loss = loss * loss_weights
    if settings.min_snr_gamma:
        alpha_bar = alphas_cumprod.to(timesteps.device)[timesteps]
        snr = (alpha_bar.sqrt() / (1.0 - alpha_bar).sqrt()) ** 2  # sd-scripts' all_snr, to the bit (not a / (1 - a))
        clipped = snr.clamp(max=settings.min_snr_gamma)
        loss = loss * (clipped / (snr + 1.0) if settings.v_parameterization else clipped / snr)
    return loss


class NoisePredictionObjective:
    """SD 1.x/2.x/SDXL: DDPM noise (epsilon or v) prediction. The loop calls :meth:`forward` under
    autocast and :meth:`loss` outside it; validation calls :meth:`fixed_forward` at a fixed timestep.
    (The family's ``objective`` picks this or ``flow_matching.FlowMatchingObjective``; same interface.)"""

    def __init__(self, noise_scheduler: NoiseScheduler, alphas_cumprod: torch.Tensor,
                 noise: NoiseSettings) -> None:
        self.noise_scheduler, self.alphas_cumprod, self.noise = noise_scheduler, alphas_cumprod, noise

    def forward(self, denoiser: torch.nn.Module, latents: torch.Tensor, hidden: torch.Tensor,
                added: dict[str, Any] | None, generator: torch.Generator) -> tuple[torch.Tensor, tuple[Any, ...]]:
        step_noise, timesteps = sample_noise_and_timesteps(latents, self.noise, generator)
        return self._predict(denoiser, latents, hidden, added, step_noise, timesteps)

    def fixed_forward(self, denoiser: torch.nn.Module, latents: torch.Tensor, hidden: torch.Tensor,
                      added: dict[str, Any] | None, timestep: int,
                      noise: torch.Tensor) -> tuple[torch.Tensor, tuple[Any, ...]]:
        import torch

        steps = torch.full((latents.shape[0],), timestep, device=latents.device, dtype=torch.long)
        return self._predict(denoiser, latents, hidden, added, noise, steps)

    def _predict(self, denoiser: torch.nn.Module, latents: torch.Tensor, hidden: torch.Tensor,
                 added: dict[str, Any] | None, noise: torch.Tensor,
                 timesteps: torch.Tensor) -> tuple[torch.Tensor, tuple[Any, ...]]:
        noisy = self.noise_scheduler.add_noise(latents, noise, timesteps)
        prediction = denoiser(noisy, timesteps, hidden, added_cond_kwargs=added).sample
        return prediction, (latents, noise, timesteps)

    def loss(self, prediction: torch.Tensor, state: tuple[Any, ...], loss_weights: torch.Tensor) -> torch.Tensor:
        """Per-sample loss (fp32)."""
        latents, noise, timesteps = state
        target = diffusion_target(self.noise_scheduler, latents, noise, timesteps, self.noise.v_parameterization)
        return per_sample_loss(prediction, target, timesteps, loss_weights, self.alphas_cumprod, self.noise)
