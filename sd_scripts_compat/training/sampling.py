"""Sample images during training (``sample_prompts`` / ``sample_every_n_*``), kohya's prompt syntax.

The prompts and their syntax are read by ``facts.sample_prompts`` (torch-free).
Rendering is the family runtime's (``runtimes``): it uses the bundle's modules, so the LoRA (already hooked into
those modules) is what is seen.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from sd_scripts_compat.facts.sample_prompts import read_sample_prompts
from sd_scripts_compat.quiet import libraries_quiet

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

    from sd_scripts_compat.config.training_config import TrainingConfig
    from sd_scripts_compat.models.build import ModelBundle
    from sd_scripts_compat.training.conditioning import Conditioner


def sample_during_training(bundle: ModelBundle, config: TrainingConfig, accelerator: Accelerator, dtype: torch.dtype,
                           resolution: tuple[int, int], *, out_dir: Path, name: str, conditioner: Conditioner) -> None:
    """Render ``sample_prompts`` on the main process with the LoRA as trained so far.

    Encoders that caching moved off the device come back for the render and leave again; the
    modules' train/eval modes are restored, so the run continues exactly as before.
    """
    if not config.sample_prompts or not accelerator.is_main_process:
        return
    prompts = read_sample_prompts(config.sample_prompts, resolution)
    training = [m.training for m in (bundle.unet, *bundle.text_encoders)]
    vae_device = next(bundle.vae.parameters()).device
    bundle.vae.to(accelerator.device)
    text_devices = [next(te.parameters()).device for te in bundle.text_encoders]
    for encoder in bundle.text_encoders:
        encoder.to(accelerator.device)
    try:
        with libraries_quiet():  # pipelines warn about their configs: nothing a trainer can act on
            conditioner.runtime.render_samples(bundle, prompts, conditioner.encode, config=config, out_dir=out_dir,
                                               name=name, device=accelerator.device, dtype=dtype)
    finally:
        bundle.vae.to(vae_device)
        for encoder, device, was_training in zip(bundle.text_encoders, text_devices, training[1:]):
            encoder.to(device)
            encoder.train(was_training)
        bundle.unet.train(training[0])
