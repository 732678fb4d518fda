"""What a goal and a priority ask of a LoRA: rank, effective batch, learning rate and amount of training.

Numbers are community practice for kohya LoRAs (see ``autotune.planning.planner``'s docstring for the
rules). ``GOALS`` and ``PRIORITIES`` are the values ``autotune plan`` accepts; ``OPTIMIZERS`` are those the planner
picks by itself (``--optimizer`` pins any the engine trains).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autotune.planning.resolution import TINY_CPU_MAX_STEPS


@dataclass(frozen=True)
class GoalProfile:
    """What a training goal asks for."""

    rank: int
    rank_floor: int
    effective_batch: int
    views_per_image: int
    min_views: int
    max_views: int
    unet_lr: float


GOAL_PROFILES: dict[str, GoalProfile] = {
    # A character needs identity detail: mid rank, many views per image on a small set.
    "character": GoalProfile(rank=32, rank_floor=8, effective_batch=4, views_per_image=100, min_views=1200,
                             max_views=4000, unet_lr=1e-4),
    # A style spreads over many images: higher rank, larger batch for smoother gradients, fewer views each.
    "style": GoalProfile(rank=64, rank_floor=16, effective_batch=8, views_per_image=50, min_views=2400,
                         max_views=10000, unet_lr=1e-4),
    # A single object or pose: low rank is enough.
    "concept": GoalProfile(rank=16, rank_floor=4, effective_batch=4, views_per_image=80, min_views=1600,
                           max_views=6000, unet_lr=1e-4),
}
PRIORITY_VIEW_SCALE = {"speed": 0.75, "balanced": 1.0, "quality": 1.25}
PRIORITY_OPTIMIZER = {"speed": "AdamW8bit", "balanced": "AdamW8bit", "quality": "AdamW"}
GOALS = tuple(GOAL_PROFILES)  # character, style, concept
PRIORITIES = tuple(PRIORITY_VIEW_SCALE)  # speed, balanced, quality
OPTIMIZERS = ("AdamW8bit", "AdamW", "Prodigy")


def network_alpha(rank: int) -> float:
    """alpha = rank / 2 (at least 1): LoRA scale 0.5 whatever the rank, so the learning-rate rule holds."""
    return float(max(1, rank // 2))


def learning_rate(goal: GoalProfile, effective_batch: int) -> float:
    """unet_lr = base x sqrt(effective batch / 4), clamped to [2.5e-5, 4e-4], 3 significant digits."""
    lr = goal.unet_lr * math.sqrt(effective_batch / 4)
    lr = min(max(lr, 2.5e-5), 4e-4)
    return float(f"{lr:.3g}")


def target_views(goal: GoalProfile, num_images: int, priority: str) -> int:
    """Image-views the goal wants: views per image x images, clamped, scaled by the priority."""
    views = min(max(goal.views_per_image * num_images, goal.min_views), goal.max_views)
    return int(round(views * PRIORITY_VIEW_SCALE[priority]))


@dataclass(frozen=True)
class TrainingLength:
    target_views: int
    epochs: int
    steps: int  # optimizer steps


def training_length(goal: GoalProfile, priority: str, num_images: int, views_per_epoch: int, effective: int,
                    pinned_epochs: int | None, short_cpu_run: bool, pinned_steps: int | None = None) -> TrainingLength:
    """Epochs and optimizer steps for the target image-views; a short CPU run keeps whole epochs that fit
    in TINY_CPU_MAX_STEPS optimizer steps (at least one); pinned steps are kept as they are."""
    target = target_views(goal, num_images, priority)
    steps_per_epoch = math.ceil(views_per_epoch / effective)
    if pinned_steps:
        return TrainingLength(target_views=target, epochs=math.ceil(pinned_steps / steps_per_epoch),
                              steps=pinned_steps)
    epochs = pinned_epochs or max(1, round(target / views_per_epoch))
    if short_cpu_run:
        epochs = max(1, min(epochs, TINY_CPU_MAX_STEPS // steps_per_epoch))
    return TrainingLength(target_views=target, epochs=epochs, steps=epochs * steps_per_epoch)
