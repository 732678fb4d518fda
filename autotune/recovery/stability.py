"""The stability ladder: from settings whose training diverged (``diverged.json``) to safer ones.

Pure functions over ``TrainSettings``, unit-tested like the OOM ladder. The watchdog rolls the run
back to its newest state (the engine saves only finite weights) and retries with the next rung that
changes something; when that retry diverges again before it gets past the step where the last one did,
the state's weights are finite but already damaged, and the watchdog runs the same settings again
from step 0 (:data:`RESTART`, no rung used); every rung is used at most once per run, and after
``StabilityLimits.max_tries`` rungs, or when no rung is left, :class:`Unstable` says so in one
message. No rung changes a tensor shape, so the saved state always fits the new settings.

Rungs, in order (cheapest loss of speed or learning first):
  1. precision: fp16 -> bf16 where the card supports it (bf16 has fp32's range: no overflow), with
     fp32 LoRA weights (full_fp16 / full_bf16 off); without bf16, ``full_fp16`` off: fp32 LoRA weights
     under accelerate's dynamic loss scale, which skips overflowing steps; ``full_bf16`` off.
  2. learning rate: every rate halved (learning_rate, unet_lr, text_encoder_lr) and a longer warm-up
     (:func:`longer_warmup`; a ``constant`` schedule becomes ``constant_with_warmup``, its warm-up form).
  3. gradient clipping: ``max_grad_norm = 1.0`` when it was off.
  4. learning rate again: every rate a quarter of the current one (an eighth of the original).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from sd_scripts_compat.facts.settings import TrainSettings

RUNGS = ("precision", "learning rate", "gradient clipping", "learning rate again")
RESTART = "restart"  # the watchdog's own step: same settings from step 0 when the state itself is damaged
CLIP_NORM = 1.0


@dataclass(frozen=True)
class StabilityLimits:
    """What the machine allows and how often the ladder may be asked."""

    bf16_supported: bool = False  # the card computes in bf16 (CUDA cc >= 8.0)
    max_tries: int = len(RUNGS)  # divergences the run may have before it is given up


@dataclass(frozen=True)
class StabilityDecision:
    """The next attempt's settings after a divergence, the rung used and why."""

    settings: TrainSettings
    changes: dict[str, tuple[Any, Any]]  # key -> (old, new)
    rung: str
    reason: str
    resume_compatible: bool = True  # no rung changes the LoRA's or the optimizer's shapes


@dataclass(frozen=True)
class Unstable:
    """Nothing safer is left: the settings of the last attempt, what was tried, what tripped last."""

    settings: TrainSettings
    tried: tuple[str, ...]
    last_reason: str

    def message(self) -> str:
        tried = "; ".join(self.tried) if self.tried else "nothing (no rung applies to these settings)"
        return (f"training keeps diverging ({self.last_reason}) and nothing safer is left to try automatically: "
                f"tried {tried}. Check the images for broken or extreme ones (autotune doctor), lower "
                f"learning_rate below {self.settings.learning_rate:g} by hand, or use another optimizer.")


def warmup_in_steps(settings: TrainSettings, max_train_steps: int | None) -> int:
    """``lr_warmup_steps`` in steps (a float below 1 is a ratio of the run, as kohya reads it)."""
    warmup = settings.lr_warmup_steps
    if isinstance(warmup, float) and warmup < 1:
        return int(warmup * max_train_steps) if max_train_steps else 0
    return int(warmup)


def longer_warmup(settings: TrainSettings, diverged_step: int | None, max_train_steps: int | None) -> int:
    """The new warm-up, in steps: twice the old one, and at least twice the step that diverged, at most
    half the run.

    Why past the divergence: the run resumes from a state saved before the bad step, and a warm-up
    that ended before it would change nothing there; ending at 2 x that step, the rate is back at
    about half (times the halving) where the trouble began and reaches the new rate well after it. The
    schedule is kohya's own, counted from step 0, so config.final.toml reproduces it from scratch.
    """
    old = warmup_in_steps(settings, max_train_steps)
    new = max(2 * old, 2 * (diverged_step or 0), 1)
    if max_train_steps:
        new = min(new, max_train_steps // 2)
    return max(new, old)


def scaled_rates(settings: TrainSettings, factor: float) -> TrainSettings:
    """Every learning rate the run sets, times ``factor`` (None stays None: kohya falls back to learning_rate)."""
    return replace(settings, learning_rate=settings.learning_rate * factor,
                   unet_lr=settings.unet_lr * factor if settings.unet_lr is not None else None,
                   text_encoder_lr=tuple(lr * factor for lr in settings.text_encoder_lr)
                   if settings.text_encoder_lr is not None else None)


def _with_warmup(settings: TrainSettings, base: TrainSettings, diverged_step: int | None,
                 max_train_steps: int | None) -> TrainSettings:
    warmup = longer_warmup(base, diverged_step, max_train_steps)
    if warmup <= warmup_in_steps(base, max_train_steps):
        return settings
    scheduler = "constant_with_warmup" if settings.lr_scheduler == "constant" else settings.lr_scheduler
    return replace(settings, lr_warmup_steps=warmup, lr_scheduler=scheduler)


def _rung(name: str, s: TrainSettings, limits: StabilityLimits, diverged_step: int | None,
          max_train_steps: int | None) -> tuple[TrainSettings, str] | None:
    """The rung's settings and why, or None when it would change nothing here."""
    lr_owned_by_optimizer = s.lr_scheduler == "adafactor"  # Adafactor's relative step sets its own rate
    if name == "precision":
        if s.mixed_precision == "fp16" and limits.bf16_supported:
            return (replace(s, mixed_precision="bf16", full_fp16=False, full_bf16=False),
                    "bf16 has the range of fp32, so activations and gradients cannot overflow as in fp16; "
                    "the LoRA weights stay fp32")
        if s.full_fp16:
            return (replace(s, full_fp16=False), "fp32 LoRA weights under accelerate's dynamic loss scale, which "
                    "skips overflowing steps (this card has no bf16)")
        if s.full_bf16:
            return replace(s, full_bf16=False), "fp32 LoRA weights: bf16 weights lose small updates"
        return None
    if name in ("learning rate", "learning rate again"):
        if lr_owned_by_optimizer or not (s.learning_rate or s.unet_lr or s.text_encoder_lr):
            return None
        factor = 0.5 if name == "learning rate" else 0.25
        new = _with_warmup(scaled_rates(s, factor), s, diverged_step, max_train_steps)
        warm = f", warm-up {new.lr_warmup_steps} steps" if new.lr_warmup_steps != s.lr_warmup_steps else ""
        return new, f"a {'halved' if factor == 0.5 else 'quartered'} learning rate{warm} takes smaller steps"
    if name == "gradient clipping":
        if s.max_grad_norm:
            return None
        return (replace(s, max_grad_norm=CLIP_NORM),
                f"clipping the gradient norm at {CLIP_NORM:g} bounds the step a single bad batch can take")
    raise ValueError(f"unknown rung {name!r}")


def next_stable_settings(failed: TrainSettings, limits: StabilityLimits, *, used: Sequence[str] = (),
                         diverged_step: int | None = None, max_train_steps: int | None = None,
                         last_reason: str = "the loss diverged") -> StabilityDecision | Unstable:
    """The next safer settings after ``failed`` diverged at ``diverged_step``.

    ``used``: the rungs earlier divergences of this run already took (from the retry log), in order;
    ``last_reason``: what the engine said tripped (for the final message).
    """
    if len(used) >= limits.max_tries:
        return Unstable(failed, tuple(used), last_reason)
    for name in RUNGS:
        if name in used:
            continue
        step = _rung(name, failed, limits, diverged_step, max_train_steps)
        if step is None:
            continue
        settings, why = step
        changes = settings.changed_from(failed)
        short = ", ".join(f"{k} {old}->{new}" for k, (old, new) in changes.items())
        return StabilityDecision(settings=settings, changes=changes, rung=name, reason=f"{name}: {short} ({why})")
    return Unstable(failed, tuple(used), last_reason)
