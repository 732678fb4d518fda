"""Validation loss on the held-out images of ``validation_split``, at fixed timesteps and noise.

Fixed timesteps and noise make successive measurements comparable (only the LoRA changed), so
over-training shows as a rising curve. ``max_validation_steps`` caps the batches of one run, as in
sd-scripts.
"""

from __future__ import annotations

import itertools
from typing import Any

from sd_scripts_compat.training.conditioning import Conditioner
from sd_scripts_compat.training.objectives import NoiseSettings

VALIDATION_TIMESTEPS = (100, 300, 500, 700, 900)


class ValidationRun:
    """When to validate (validate_every_n_*), how (the model, noise and seed it was built with), and
    the history of ``(step, loss)`` measured so far."""

    def __init__(self, dataset: Any, config: Any, seed: int, *, unet: Any, conditioner: Conditioner,
                 noise_scheduler: Any, dtype: Any, accelerator: Any, noise_settings: NoiseSettings,
                 alphas_cumprod: Any) -> None:
        self.dataset = dataset
        self.every_steps = config.validate_every_n_steps
        self.every_epochs = config.validate_every_n_epochs
        self.max_batches = config.max_validation_steps
        self.seed = config.validation_seed if config.validation_seed is not None else seed
        self.unet, self.conditioner, self.noise_scheduler = unet, conditioner, noise_scheduler
        self.dtype, self.accelerator = dtype, accelerator
        self.noise_settings, self.alphas_cumprod = noise_settings, alphas_cumprod
        self.history: list[tuple[int, float]] = []

    def due(self, step: int, *, epoch_end: bool, epoch: int = 0) -> bool:
        """At every_n_steps steps, at every_n_epochs epoch ends, and at every epoch end when neither is set."""
        if epoch_end:
            return bool(self.every_epochs and epoch % self.every_epochs == 0) or (
                not self.every_steps and not self.every_epochs)
        return bool(self.every_steps and step % self.every_steps == 0)

    def run(self, step: int) -> float:
        loss = validation_loss(self.dataset, self.unet, self.conditioner, self.noise_scheduler, self.dtype,
                               self.accelerator.device, self.seed, self.noise_settings, self.alphas_cumprod,
                               max_batches=self.max_batches)
        self.history.append((step, loss))
        self.accelerator.log({"loss/validation": loss}, step=step)
        self.accelerator.print(f"\nvalidation loss at step {step}: {loss:.5f}")
        return loss


def validation_loss(dataset: Any, unet: Any, conditioner: Conditioner, noise_scheduler: Any, dtype: Any, device: Any,
                    seed: int, noise_settings: NoiseSettings, alphas_cumprod: Any,
                    timesteps: tuple[int, ...] = VALIDATION_TIMESTEPS, max_batches: int | None = None) -> float:
    """Mean loss over the held-out batches (the first ``max_batches`` when given) at each of
    ``timesteps``, with noise drawn from ``seed``."""
    import torch

    from sd_scripts_compat.caching.latent_cache import encode_images
    from sd_scripts_compat.dataset.train_dataset import BucketBatchSampler, make_dataloader
    from sd_scripts_compat.training.devices import to_device
    from sd_scripts_compat.training.objectives import diffusion_target, per_sample_loss

    was_training = unet.training
    unet.eval()
    total, count = torch.zeros((), device=device), 0
    generator = torch.Generator(device=device).manual_seed(seed)
    batches = make_dataloader(dataset, BucketBatchSampler(dataset, epoch=0))
    with torch.no_grad():
        for index, batch in enumerate(itertools.islice(batches, max_batches)):
            batch = to_device(batch, device)
            if "latents" in batch:
                latents = batch["latents"].to(dtype)
            else:
                vae = conditioner.bundle.vae
                seeds = [seed + 7919 * index + i for i in range(batch["images"].shape[0])]
                latents = encode_images(vae, batch["images"], scaling_factor=vae.config.scaling_factor,
                                        noise_seeds=seeds).to(dtype)
            hidden, added = conditioner.condition(batch, train=False)
            for t in timesteps:
                noise = torch.randn(latents.shape, generator=generator, device=device, dtype=latents.dtype)
                steps = torch.full((latents.shape[0],), t, device=device, dtype=torch.long)
                noisy = noise_scheduler.add_noise(latents, noise, steps)
                with torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype != torch.float32):
                    prediction = unet(noisy, steps, hidden, added_cond_kwargs=added).sample
                target = diffusion_target(noise_scheduler, latents, noise, steps, noise_settings.v_parameterization)
                ones = torch.ones(latents.shape[0], device=device)
                total += per_sample_loss(prediction, target, steps, ones, alphas_cumprod, noise_settings).sum()
                count += latents.shape[0]
    unet.train(was_training)
    return (total / max(count, 1)).item()
