"""SD3's rectified-flow objective as sd-scripts' ``sd3_train_network.py`` defines it.

``u`` drawn by ``weighting_scheme``'s density (logit_normal, mode, else uniform), shifted by ``training_shift``
(``u * s / (1 + (s - 1) * u)``), made a whole timestep in [``min_timestep``, ``max_timestep``); sigma =
timestep / 1000; noisy input ``sigma * noise + (1 - sigma) * latents``. The MMDiT's output is preconditioned to an
image estimate (``pred * -sigma + noisy``) and compared with the latents, weighted per sample by the scheme
(sigma_sqrt, cosmap; else 1). The latent image goes in as it is (the MMDiT patches it itself).
Every random draw comes from the per-step generator the loop passes (exact resume), as for FLUX.1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sd_scripts_compat.runtimes.flow_matching import NUM_TRAIN_TIMESTEPS, flow_loss, loss_weighting

if TYPE_CHECKING:
    import torch

    from sd_scripts_compat.config.training_config import TrainingConfig


@dataclass(frozen=True)
class Sd3FlowSettings:
    """kohya's SD3 objective options (defaults: sd-scripts')."""

    weighting_scheme: str = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    training_shift: float = 1.0
    min_timestep: int = 0
    max_timestep: int = NUM_TRAIN_TIMESTEPS

    @classmethod
    def from_config(cls, config: TrainingConfig) -> Sd3FlowSettings:
        return cls(weighting_scheme=config.weighting_scheme, logit_mean=config.logit_mean,
                   logit_std=config.logit_std, mode_scale=config.mode_scale, training_shift=config.training_shift,
                   min_timestep=config.min_timestep or 0,
                   max_timestep=config.max_timestep if config.max_timestep is not None else NUM_TRAIN_TIMESTEPS)


def sample_timesteps(settings: Sd3FlowSettings, batch: int, generator: torch.Generator,
                     device: str | torch.device) -> torch.Tensor:
    """Whole timesteps (as floats) for one batch: the scheme's density, shifted, scaled to the range."""
    from sd_scripts_compat.runtimes.flow_matching import FlowMatchSettings, _density

    density = FlowMatchSettings(weighting_scheme=settings.weighting_scheme, logit_mean=settings.logit_mean,
                                logit_std=settings.logit_std, mode_scale=settings.mode_scale)
    u = _density(density, batch, generator, device)
    shift = settings.training_shift
    u = (u * shift) / (1 + (shift - 1) * u)
    return (u * (settings.max_timestep - settings.min_timestep) + settings.min_timestep).long().float()


class Sd3FlowObjective:
    """The loop's ``forward`` (under autocast) / ``loss`` / ``fixed_forward`` (validation at timestep t)."""

    def __init__(self, settings: Sd3FlowSettings) -> None:
        self.settings = settings

    def forward(self, denoiser: torch.nn.Module, latents: torch.Tensor, hidden: torch.Tensor,
                added: dict[str, Any] | None, generator: torch.Generator) -> tuple[torch.Tensor, tuple[Any, ...]]:
        import torch

        noise = torch.randn(latents.shape, generator=generator, device=latents.device, dtype=latents.dtype)
        timesteps = sample_timesteps(self.settings, latents.shape[0], generator, latents.device)
        return self._predict(denoiser, latents, hidden, added, noise, timesteps)

    def fixed_forward(self, denoiser: torch.nn.Module, latents: torch.Tensor, hidden: torch.Tensor,
                      added: dict[str, Any] | None, timestep: int,
                      noise: torch.Tensor) -> tuple[torch.Tensor, tuple[Any, ...]]:
        import torch

        timesteps = torch.full((latents.shape[0],), float(timestep), device=latents.device)
        return self._predict(denoiser, latents, hidden, added, noise, timesteps)

    def _predict(self, denoiser: torch.nn.Module, latents: torch.Tensor, hidden: torch.Tensor,
                 added: dict[str, Any] | None, noise: torch.Tensor,
                 timesteps: torch.Tensor) -> tuple[torch.Tensor, tuple[Any, ...]]:
        sigmas = (timesteps / NUM_TRAIN_TIMESTEPS).view(-1, 1, 1, 1)
        noisy = sigmas.to(latents.dtype) * noise + (1.0 - sigmas.to(latents.dtype)) * latents
        out = denoiser(hidden_states=noisy, encoder_hidden_states=hidden, pooled_projections=(added or {})["pooled"],
                       timestep=timesteps.to(noisy.dtype), return_dict=False)[0]
        return out * (-sigmas.to(out.dtype)) + noisy, (latents, sigmas.flatten())

    def loss(self, prediction: torch.Tensor, state: tuple[Any, ...], loss_weights: torch.Tensor) -> torch.Tensor:
        latents, sigmas = state
        return flow_loss(prediction, latents, loss_weighting(self.settings.weighting_scheme, sigmas), loss_weights)


def sd3_metadata(config: TrainingConfig) -> dict[str, str]:
    """The ``ss_`` keys sd-scripts adds to an SD3 LoRA's metadata (every value a string, as kohya writes)."""
    names = ("apply_lg_attn_mask", "apply_t5_attn_mask", "weighting_scheme", "logit_mean", "logit_std", "mode_scale")
    return {f"ss_{name}": str(getattr(config, name)) for name in names}
