"""Validation runs on the tiny SD1.5 model, in process: ``max_validation_steps`` caps the held-out
batches each validation run reads, as in sd-scripts, and a capped run is as repeatable as a full one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from sd_scripts_compat.config.training_config import load_training_config
from sd_scripts_compat.dataset.train_dataset import TrainDataset, build_dataset
from sd_scripts_compat.facts.dataset_spec import DatasetSpec, SubsetSpec
from sd_scripts_compat.facts.families import get_family
from sd_scripts_compat.models.build import build_modules
from sd_scripts_compat.runtimes import TextOptions, runtime_for
from sd_scripts_compat.runtimes.noise_prediction import NoiseSettings
from sd_scripts_compat.training.conditioning import Conditioner
from sd_scripts_compat.training.validation import ValidationRun


@pytest.fixture(scope="module")
def sd15():
    return build_modules(get_family("tiny-sd15"))


def held_out(tmp_path: Path, images: int = 4) -> TrainDataset:
    """``images`` different 32 px images with their own captions, one per batch."""
    folder = tmp_path / "1_x"
    folder.mkdir()
    for i in range(images):
        Image.new("RGB", (32, 32), (60 * i, 200 - 40 * i, 90)).save(folder / f"{i}.png")
        (folder / f"{i}.txt").write_text(f"a picture number {i}", encoding="utf-8")
    spec = DatasetSpec(subsets=(SubsetSpec(str(folder), caption_extension=".txt"),), resolution=(32, 32),
                       batch_size=1)
    return build_dataset(spec, seed=0, split="train")


def record_loaded_batches(dataset: TrainDataset) -> list[int]:
    """The step index of every batch the dataset loads from now on (the real collate still runs)."""
    loaded: list[int] = []
    collate = dataset.collate

    def recording_collate(items, *, epoch, step):
        loaded.append(step)
        return collate(items, epoch=epoch, step=step)

    dataset.collate = recording_collate
    return loaded


def validation_run(dataset: TrainDataset, bundle, *flags: str) -> ValidationRun:
    from accelerate import Accelerator
    from diffusers import DDPMScheduler

    config = load_training_config(["--validate_every_n_steps", "5", *flags], sdxl=False)
    scheduler = DDPMScheduler.from_config(bundle.scheduler_config)
    conditioner = Conditioner(bundle, runtime_for(bundle.family), TextOptions(dtype=torch.float32))
    return ValidationRun(dataset, config, 0, unet=bundle.unet, conditioner=conditioner, noise_scheduler=scheduler,
                         dtype=torch.float32, accelerator=Accelerator(cpu=True), noise_settings=NoiseSettings(),
                         alphas_cumprod=scheduler.alphas_cumprod)


def test_max_validation_steps_caps_the_batches_of_every_validation_run(tmp_path, sd15):
    dataset = held_out(tmp_path)
    loaded = record_loaded_batches(dataset)
    capped = validation_run(dataset, sd15, "--max_validation_steps", "2")
    first = capped.run(5)
    assert loaded == [0, 1]  # two of the four held-out batches, not a third one fetched and dropped
    loaded.clear()
    again = capped.run(10)
    assert loaded == [0, 1] and again == first  # same batches, same noise: the LoRA did not change
    assert capped.history == [(5, first), (10, again)]

    loaded.clear()
    full = validation_run(dataset, sd15).run(5)
    assert loaded == [0, 1, 2, 3] and full != first
    loaded.clear()
    above = validation_run(dataset, sd15, "--max_validation_steps", "10").run(5)
    assert loaded == [0, 1, 2, 3] and above == full  # "at most N": fewer batches than N means all of them
