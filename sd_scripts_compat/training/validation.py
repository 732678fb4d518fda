"""Validation loss on the held-out images of ``validation_split``, at fixed timesteps and noise.

Fixed timesteps and noise make successive measurements comparable (only the LoRA changed), so
over-training shows as a rising curve. ``max_validation_steps`` caps the batches of one run, as in
sd-scripts.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from sd_scripts_compat.runtimes.noise_prediction import NoiseSettings
from sd_scripts_compat.training.conditioning import Conditioner

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

    from sd_scripts_compat.config.training_config import TrainingConfig
    from sd_scripts_compat.dataset.train_dataset import TrainDataset
    from sd_scripts_compat.runtimes import Objective
    from sd_scripts_compat.runtimes.noise_prediction import NoiseScheduler
    from sd_scripts_compat.training.faults import FaultyObjective

VALIDATION_TIMESTEPS = (100, 300, 500, 700, 900)


class ValidationRun:
    """When to validate (validate_every_n_*), how (the model, noise and seed it was built with), and
    the history of ``(step, loss)`` measured so far."""

    def __init__(self, dataset: TrainDataset, config: TrainingConfig, seed: int, *, unet: torch.nn.Module,
                 conditioner: Conditioner, noise_scheduler: NoiseScheduler | None = None, dtype: torch.dtype,
                 accelerator: Accelerator, noise_settings: NoiseSettings | None = None,
                 alphas_cumprod: torch.Tensor | None = None,
                 objective: Objective | FaultyObjective | None = None) -> None:
        from sd_scripts_compat.runtimes.noise_prediction import NoisePredictionObjective

        self.dataset = dataset
        self.every_steps = config.validate_every_n_steps
        self.every_epochs = config.validate_every_n_epochs
        self.max_batches = config.max_validation_steps
        self.seed = config.validation_seed if config.validation_seed is not None else seed
        self.unet, self.conditioner, self.noise_scheduler = unet, conditioner, noise_scheduler
        self.dtype, self.accelerator = dtype, accelerator
        if objective is None:
            if noise_scheduler is None:
                raise ValueError("ValidationRun needs the run's objective or its noise scheduler")
            alphas = alphas_cumprod if alphas_cumprod is not None else noise_scheduler.alphas_cumprod
            objective = NoisePredictionObjective(noise_scheduler, alphas, noise_settings or NoiseSettings())
        self.objective = objective
        self.history: list[tuple[int, float]] = []

    def due(self, step: int, *, epoch_end: bool, epoch: int = 0) -> bool:
        """At every_n_steps steps, at every_n_epochs epoch ends, and at every epoch end when neither is set."""
        if epoch_end:
            return bool(self.every_epochs and epoch % self.every_epochs == 0) or (
                not self.every_steps and not self.every_epochs)
        return bool(self.every_steps and step % self.every_steps == 0)

    def run(self, step: int) -> float:
        loss = validation_loss(self.dataset, self.unet, self.conditioner, self.objective, self.dtype,
                               self.accelerator.device, self.seed, max_batches=self.max_batches)
        self.history.append((step, loss))
        self.accelerator.log({"loss/validation": loss}, step=step)
        self.accelerator.print(f"\nvalidation loss at step {step}: {loss:.5f}")
        return loss


def validation_loss(dataset: TrainDataset, unet: torch.nn.Module, conditioner: Conditioner,
                    objective: Objective | FaultyObjective, dtype: torch.dtype, device: torch.device, seed: int,
                    timesteps: tuple[int, ...] = VALIDATION_TIMESTEPS, max_batches: int | None = None) -> float:
    """Mean loss over the held-out batches (the first ``max_batches`` when given) at each of
    ``timesteps`` (of 1000; FLUX: sigma t/1000), with noise drawn from ``seed``; ``objective`` is the run's
    (``objectives.NoisePredictionObjective`` or ``flow_matching.FlowMatchingObjective``)."""
    import torch

    from sd_scripts_compat.caching.latent_cache import encode_images, latent_factors
    from sd_scripts_compat.dataset.train_dataset import BucketBatchSampler, make_dataloader
    from sd_scripts_compat.training.devices import to_device

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
                latents = encode_images(vae, batch["images"], noise_seeds=seeds, **latent_factors(vae)).to(dtype)
            hidden, added = conditioner.condition(batch, train=False)
            for t in timesteps:
                noise = torch.randn(latents.shape, generator=generator, device=device, dtype=latents.dtype)
                with torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype != torch.float32):
                    prediction, state = objective.fixed_forward(unet, latents, hidden, added, t, noise)
                ones = torch.ones(latents.shape[0], device=device)
                total += objective.loss(prediction, state, ones).sum()
                count += latents.shape[0]
    unet.train(was_training)
    return (total / max(count, 1)).item()
