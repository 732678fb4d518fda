"""Writing sample images: each prompt rendered without gradients under autocast and saved atomically as
``{name}_{index:02d}.png`` (the SD pipelines', FLUX.1's and SD3's samplers share it)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    import PIL.Image
    import torch

    from sd_scripts_compat.facts.sample_prompts import SamplePrompt


def write_each(prompts: list[Any], render: Callable[[SamplePrompt, int, int, int], PIL.Image.Image], *, step: int,
               out_dir: Path, name: str, device: str | torch.device, dtype: torch.dtype) -> list[Path]:
    """``render(sample, width, height, seed)`` for each prompt (sizes made whole ``step`` px, the seed its ``--d`` or
    its index) without gradients under autocast, written to ``out_dir/{name}_{index:02d}.png`` atomically."""
    import torch

    from sd_scripts_compat.facts.atomic import atomic_path

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for index, sample in enumerate(prompts):
        width, height = max(step, sample.width // step * step), max(step, sample.height // step * step)
        with torch.no_grad(), torch.autocast(device_type=torch.device(device).type, dtype=dtype,
                                             enabled=dtype != torch.float32):
            image = render(sample, width, height, sample.seed if sample.seed is not None else index)
        target = out_dir / f"{name}_{index:02d}.png"
        with atomic_path(target, suffix=".png") as tmp:
            image.save(tmp)
        written.append(target)
    return written
