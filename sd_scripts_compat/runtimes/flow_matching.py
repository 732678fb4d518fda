"""FLUX.1's rectified-flow objective as sd-scripts' ``flux_train_network.py`` defines it.

Noisy input ``(1 - sigma) * latents + sigma * noise``, target ``noise - latents``; sigma drawn by
``timestep_sampling`` (sigma: the shifted discrete schedule, ``discrete_flow_shift`` 3.0, with the
``weighting_scheme`` density; uniform; sigmoid(``sigmoid_scale`` * N(0, 1)); shift; flux_shift, whose
shift grows with the image's token count), the prediction read as ``model_prediction_type`` (raw,
additive, sigma_scaled: then ``weighting_scheme`` weights the loss). Latents are packed 2x2 into tokens
with their position ids, as the FLUX transformer takes them.

Plain tensor functions and one frozen settings object, no state: every random draw comes from the
per-step generator the loop passes, so step N draws the same sigmas after a resume. The shifted schedule
is diffusers' ``FlowMatchEulerDiscreteScheduler`` (the same table sd-scripts builds by hand).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from diffusers import ChromaTransformer2DModel, FluxTransformer2DModel

    from sd_scripts_compat.config.training_config import TrainingConfig

NUM_TRAIN_TIMESTEPS = 1000


@dataclass(frozen=True)
class FlowMatchSettings:
    """kohya's FLUX objective options (defaults: sd-scripts')."""

    timestep_sampling: str = "sigma"
    sigmoid_scale: float = 1.0
    discrete_flow_shift: float = 3.0
    model_prediction_type: str = "sigma_scaled"
    weighting_scheme: str = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    guidance_scale: float = 3.5

    @classmethod
    def from_config(cls, config: TrainingConfig) -> FlowMatchSettings:
        return cls(timestep_sampling=config.timestep_sampling, sigmoid_scale=config.sigmoid_scale,
                   discrete_flow_shift=config.discrete_flow_shift, model_prediction_type=config.model_prediction_type,
                   weighting_scheme=config.weighting_scheme, logit_mean=config.logit_mean, logit_std=config.logit_std,
                   mode_scale=config.mode_scale, guidance_scale=config.guidance_scale)


def shifted_schedule(shift: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(timesteps, sigmas) of the discrete training schedule, 1000 entries from sigma 1 down."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler: Any = FlowMatchEulerDiscreteScheduler(num_train_timesteps=NUM_TRAIN_TIMESTEPS, shift=shift)
    return scheduler.timesteps.float(), scheduler.sigmas[:NUM_TRAIN_TIMESTEPS].float()


def time_shift(mu: float, sigmas: torch.Tensor) -> torch.Tensor:
    """FLUX's resolution-dependent shift: e^mu / (e^mu + (1/sigma - 1))."""
    return math.exp(mu) / (math.exp(mu) + (1.0 / sigmas - 1.0))


def flux_mu(image_tokens: int, base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """The shift's mu for an image of ``image_tokens`` packed tokens: linear from 256 tokens (0.5) to 4096 (1.15)."""
    slope = (max_shift - base_shift) / (4096 - 256)
    return base_shift + slope * (image_tokens - 256)


def _density(settings: FlowMatchSettings, batch: int, generator: torch.Generator,
             device: str | torch.device) -> torch.Tensor:
    """u in [0, 1) per sample for the "sigma" sampling: uniform, logit-normal or mode (SD3 paper, 3.1)."""
    import torch

    if settings.weighting_scheme == "logit_normal":
        normal = torch.randn((batch,), generator=generator, device=device)
        return torch.sigmoid(normal * settings.logit_std + settings.logit_mean)
    u = torch.rand((batch,), generator=generator, device=device)
    if settings.weighting_scheme == "mode":
        u = 1 - u - settings.mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    return u


def sample_sigmas(settings: FlowMatchSettings, batch: int, latent_hw: tuple[int, int], generator: torch.Generator,
                  device: str | torch.device, schedule: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(timesteps in [0, 1000], sigmas in [0, 1]) for one batch, per ``timestep_sampling``."""
    import torch

    mode = settings.timestep_sampling
    if mode in ("uniform", "sigmoid"):
        if mode == "sigmoid":
            sigmas = torch.sigmoid(settings.sigmoid_scale * torch.randn((batch,), generator=generator, device=device))
        else:
            sigmas = torch.rand((batch,), generator=generator, device=device)
        return sigmas * NUM_TRAIN_TIMESTEPS, sigmas
    if mode in ("shift", "flux_shift"):
        sigmas = (torch.randn((batch,), generator=generator, device=device) * settings.sigmoid_scale).sigmoid()
        if mode == "shift":
            shift = settings.discrete_flow_shift
            sigmas = (sigmas * shift) / (1 + (shift - 1) * sigmas)
        else:
            sigmas = time_shift(flux_mu((latent_hw[0] // 2) * (latent_hw[1] // 2)), sigmas)
        return sigmas * NUM_TRAIN_TIMESTEPS, sigmas
    if mode != "sigma":
        raise ValueError(f"unknown timestep_sampling {mode!r}")
    timesteps, table = schedule if schedule is not None else shifted_schedule(settings.discrete_flow_shift)
    indices = (_density(settings, batch, generator, device) * NUM_TRAIN_TIMESTEPS).long().clamp(max=len(table) - 1)
    indices = indices.cpu()
    return timesteps[indices].to(device), table[indices].to(device)


def noisy_latents(latents: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """The point on the straight path from the image (sigma 0) to pure noise (sigma 1)."""
    s = sigmas.view(-1, *([1] * (latents.ndim - 1))).to(latents.dtype)
    return (1.0 - s) * latents + s * noise


def flow_target(latents: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The velocity the model learns: noise - latents."""
    return noise - latents


def loss_weighting(weighting_scheme: str, sigmas: torch.Tensor) -> torch.Tensor:
    """Per-sample loss weights (SD3 paper): sigma_sqrt 1/sigma^2, cosmap 2/(pi(1 - 2s + 2s^2)), else 1."""
    import torch

    if weighting_scheme == "sigma_sqrt":
        return (sigmas ** -2.0).float()
    if weighting_scheme == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas ** 2))
    return torch.ones_like(sigmas)


def apply_prediction_type(settings: FlowMatchSettings, prediction: torch.Tensor, noisy: torch.Tensor,
                          sigmas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The prediction as the loss compares it, and per-sample loss weights (sigma_scaled only)."""
    kind = settings.model_prediction_type
    if kind == "raw":
        return prediction, None
    if kind == "additive":
        return prediction + noisy, None
    if kind != "sigma_scaled":
        raise ValueError(f"unknown model_prediction_type {kind!r}")
    s = sigmas.view(-1, *([1] * (prediction.ndim - 1))).to(prediction.dtype)
    return prediction * (-s) + noisy, loss_weighting(settings.weighting_scheme, sigmas)


def flow_loss(prediction: torch.Tensor, target: torch.Tensor, weighting: torch.Tensor | None,
              loss_weights: torch.Tensor) -> torch.Tensor:
    """MSE per sample in fp32 (times the scheme's weighting inside, as sd-scripts), times each sample's weight."""
    import torch.nn.functional as F

    loss = F.mse_loss(prediction.float(), target.float(), reduction="none")
    if weighting is not None:
        loss = loss * weighting.view(-1, *([1] * (loss.ndim - 1))).float()
    return loss.mean(dim=tuple(range(1, loss.ndim))) * loss_weights


# ---- packing: 16-channel latents <-> the transformer's tokens ---------------------------------------

def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, 2h, 2w] -> [B, h*w, C*4]: each 2x2 patch one token (channel-major within the token)."""
    b, c, height, width = latents.shape
    x = latents.reshape(b, c, height // 2, 2, width // 2, 2)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (height // 2) * (width // 2), c * 4)


def unpack_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[B, h*w, C*4] -> [B, C, 2h, 2w] for a packed grid of ``height`` x ``width`` tokens."""
    b, _, packed = tokens.shape
    c = packed // 4
    x = tokens.reshape(b, height, width, c, 2, 2)
    return x.permute(0, 3, 1, 4, 2, 5).reshape(b, c, height * 2, width * 2)


def image_ids(height: int, width: int, device: str | torch.device | None = None,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """[h*w, 3] position ids of the packed image tokens: (0, row, column)."""
    import torch

    ids = torch.zeros(height, width, 3, device=device, dtype=dtype)
    ids[..., 1] = torch.arange(height, device=device)[:, None]
    ids[..., 2] = torch.arange(width, device=device)[None, :]
    return ids.reshape(height * width, 3)


def text_ids(length: int, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[L, 3] zeros: FLUX gives text tokens no position (T5 encoded it)."""
    import torch

    return torch.zeros(length, 3, device=device, dtype=dtype)


def flux_prediction(transformer: FluxTransformer2DModel | ChromaTransformer2DModel, noisy: torch.Tensor,
                    timesteps: torch.Tensor, t5_hidden: torch.Tensor, pooled: torch.Tensor | None,
                    t5_mask: torch.Tensor | None, guidance_scale: float) -> torch.Tensor:
    """The transformer's velocity for unpacked latents [B, C, H, W] (returned unpacked, same shape).

    ``timesteps`` are in [0, 1000] (diffusers' FLUX transformer multiplies its input by 1000, hence the
    division); the guidance embedding is used when the model has one (dev), ignored otherwise (schnell).
    A T5 mask (``apply_t5_attn_mask``) hides the padding tokens from the joint attention.
    """
    import torch

    batch, _, height, width = noisy.shape
    packed_h, packed_w = height // 2, width // 2
    tokens = pack_latents(noisy)
    img_ids = image_ids(packed_h, packed_w, device=noisy.device, dtype=noisy.dtype)
    txt_ids = text_ids(t5_hidden.shape[1], device=noisy.device, dtype=noisy.dtype)
    if hasattr(transformer, "distilled_guidance_layer"):  # Chroma: no pooled vector, its approximator's guidance 0
        out = transformer(hidden_states=tokens, encoder_hidden_states=t5_hidden, img_ids=img_ids, txt_ids=txt_ids,
                          timestep=timesteps.to(noisy.dtype) / NUM_TRAIN_TIMESTEPS,
                          attention_mask=chroma_attention_mask(t5_mask, tokens.shape[1]), return_dict=False)[0]
        return unpack_latents(out, packed_h, packed_w)
    guidance = None
    if transformer.config.guidance_embeds:
        guidance = torch.full((batch,), float(guidance_scale), device=noisy.device, dtype=torch.float32)
    attention = None
    if t5_mask is not None:
        image_part = torch.ones((batch, tokens.shape[1]), dtype=torch.bool, device=noisy.device)
        joint = torch.cat([t5_mask.to(noisy.device).bool(), image_part], dim=1)  # text tokens come first
        attention = {"attention_mask": joint[:, None, None, :]}
    out = transformer(hidden_states=tokens, encoder_hidden_states=t5_hidden, pooled_projections=pooled,
                      timestep=timesteps.to(noisy.dtype) / NUM_TRAIN_TIMESTEPS, img_ids=img_ids, txt_ids=txt_ids,
                      guidance=guidance, joint_attention_kwargs=attention, return_dict=False)[0]
    return unpack_latents(out, packed_h, packed_w)


def chroma_attention_mask(t5_mask: torch.Tensor | None, image_tokens: int) -> torch.Tensor | None:
    """Chroma's joint mask [B, text + image]: each caption's tokens and one padding token after them (sd-scripts'
    ``attn_padding=1``, diffusers' Chroma pipeline alike), then every image token; None without a T5 mask."""
    import torch

    if t5_mask is None:
        return None
    lengths = t5_mask.sum(dim=1, keepdim=True)
    text = torch.arange(t5_mask.shape[1], device=t5_mask.device)[None, :] <= lengths
    image = torch.ones((t5_mask.shape[0], image_tokens), dtype=torch.bool, device=t5_mask.device)
    return torch.cat([text, image], dim=1)


class FlowMatchingObjective:
    """FLUX.1's objective with the interface of ``objectives.NoisePredictionObjective``: :meth:`forward`
    (under autocast), :meth:`loss` (outside), :meth:`fixed_forward` (validation at timestep t: sigma t/1000)."""

    def __init__(self, settings: FlowMatchSettings, device: str | torch.device) -> None:
        self.settings = settings
        self.schedule = shifted_schedule(settings.discrete_flow_shift)

    def forward(self, denoiser: torch.nn.Module, latents: torch.Tensor, hidden: torch.Tensor,
                added: dict[str, Any] | None, generator: torch.Generator) -> tuple[torch.Tensor, tuple[Any, ...]]:
        import torch

        noise = torch.randn(latents.shape, generator=generator, device=latents.device, dtype=latents.dtype)
        timesteps, sigmas = sample_sigmas(self.settings, latents.shape[0], (latents.shape[-2], latents.shape[-1]),
                                          generator, latents.device, self.schedule)
        return self._predict(denoiser, latents, hidden, added, noise, timesteps, sigmas)

    def fixed_forward(self, denoiser: torch.nn.Module, latents: torch.Tensor, hidden: torch.Tensor,
                      added: dict[str, Any] | None, timestep: int,
                      noise: torch.Tensor) -> tuple[torch.Tensor, tuple[Any, ...]]:
        import torch

        sigmas = torch.full((latents.shape[0],), timestep / NUM_TRAIN_TIMESTEPS, device=latents.device)
        return self._predict(denoiser, latents, hidden, added, noise, sigmas * NUM_TRAIN_TIMESTEPS, sigmas)

    def _predict(self, denoiser: torch.nn.Module, latents: torch.Tensor, hidden: torch.Tensor,
                 added: dict[str, Any] | None, noise: torch.Tensor, timesteps: torch.Tensor,
                 sigmas: torch.Tensor) -> tuple[torch.Tensor, tuple[Any, ...]]:
        noisy = noisy_latents(latents, noise, sigmas)
        added = added or {}
        prediction = flux_prediction(denoiser, noisy, timesteps, hidden, added.get("pooled"), added.get("t5_attn_mask"),
                                     self.settings.guidance_scale)
        return prediction, (latents, noise, noisy, sigmas)

    def loss(self, prediction: torch.Tensor, state: tuple[Any, ...], loss_weights: torch.Tensor) -> torch.Tensor:
        latents, noise, noisy, sigmas = state
        prediction, weighting = apply_prediction_type(self.settings, prediction, noisy, sigmas)
        return flow_loss(prediction, flow_target(latents, noise), weighting, loss_weights)


def flux_metadata(config: TrainingConfig) -> dict[str, str]:
    """The ``ss_`` keys sd-scripts adds to a FLUX.1 LoRA's metadata (every value a string, as kohya writes)."""
    names = ("model_type", "apply_t5_attn_mask", "weighting_scheme", "logit_mean", "logit_std", "mode_scale",
             "guidance_scale", "timestep_sampling", "sigmoid_scale", "model_prediction_type", "discrete_flow_shift")
    return {f"ss_{name}": str(getattr(config, name)) for name in names}
