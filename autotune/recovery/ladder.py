"""The OOM step-down ladder: from settings that ran out of memory to the next settings that fit.

Pure functions over small dataclasses, so every decision is unit-testable without a GPU. The
memory prediction comes in as a callable (``predict(settings) -> MiB``) built from the memory
model by :func:`memory_predictor`; a measurement from the failed run rescales it, because the
failure itself proves the model was optimistic for this machine.

The rungs are the settings space's (``sd_scripts_compat.facts.settings_space``: the same moves the planner and
the wizard make), walked in the OOM policy's order (cheapest loss of quality/speed first):
  1. the optimizer's state split across the run's processes (several GPUs, our engine:
     ``shard_optimizer_state``; nothing trained changes, the LoRA crosses the link once more per step)
  2. smaller micro-batch, more gradient accumulation (micro x accum, the effective batch, unchanged)
  3. gradient checkpointing on
  4. 8-bit optimizer (AdamW -> AdamW8bit, Lion -> Lion8bit)
  5. text-encoder output caching (SDXL; implies training the UNet only)
  6. the denoiser sharded across the run's processes (several GPUs, our engine: ``fsdp = "hybrid_shard"`` within
     groups, then ``"full_shard"`` across all, then each share in host RAM)
  7. more swapped blocks (families that swap, FLUX: one more block at a time up to the family's maximum;
     slower only once the host link is the bottleneck, and quality is untouched; not beside sharding)
  8. lower max bucket resolution (down to the training resolution)
  9. lower resolution (in bucket steps, down to a floor)
  10. lower rank (halving, alpha kept in proportion so the LoRA's scale is unchanged)
  11. fp8 base weights, where the card supports it
The ladder is walked cumulatively: a rung's mildest option that is predicted to fit wins; if none
fits, the rung's strongest option is kept and the next rung is tried on top of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from autotune.estimate.memory_view import AS_MODELLED, MemoryView
from sd_scripts_compat.facts.families import FamilySpec
from sd_scripts_compat.facts.settings import TrainSettings
from sd_scripts_compat.facts.settings_space import OOM_POLICY, Limits, rungs


@dataclass(frozen=True)
class LadderLimits(Limits):
    """What the machine and the model family allow the ladder to do, and the memory it must fit in."""

    budget_mib: float = 0.0  # usable memory on the device (VRAM, or RAM / address-space limit on CPU)

    @classmethod
    def for_family(cls, family: FamilySpec, budget_mib: float, *, fp8_supported: bool,
                   te_cache_allowed: bool) -> LadderLimits:
        """The limits the family's data sets (swap maximum, resolution step and floor), with the machine's
        (budget, fp8, text-encoder caching) on top."""
        from autotune.planning.resolution import step_and_floor

        step, floor = step_and_floor(family)
        return cls(budget_mib=budget_mib, is_sdxl=family.is_sdxl, resolution_step=step, min_resolution=floor,
                   max_blocks_to_swap=family.max_blocks_to_swap, keys=family.config_keys,
                   frame_step=family.temporal_stride or 4, fp8_supported=fp8_supported,
                   te_cache_allowed=te_cache_allowed)


@dataclass(frozen=True)
class Decision:
    """The next attempt's settings, why, and what the (rescaled) model predicts for them."""

    settings: TrainSettings
    changes: dict[str, tuple[Any, Any]]  # key -> (old, new)
    reasons: tuple[str, ...]
    predicted_mib: float  # rescaled prediction for the new settings
    scale: float  # measured / predicted factor applied
    resume_compatible: bool  # False when the saved state cannot be loaded (rank, optimizer, TE LoRA dropped)

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)


@dataclass(frozen=True)
class Exhausted:
    """Nothing on the ladder is predicted to fit: the smallest configuration and what it needs."""

    floor: TrainSettings
    needed_mib: float
    budget_mib: float
    tried: tuple[str, ...] = field(default_factory=tuple)
    scale: float = 1.0  # measured / predicted factor applied to needed_mib

    def message(self) -> str:
        tried = "; ".join(self.tried) if self.tried else "nothing else"
        return (f"out of memory and nothing left to step down: tried {tried}. The smallest configuration "
                f"({self.floor.describe()}) needs about {self.needed_mib / 1024:.2f} GiB but only "
                f"{self.budget_mib / 1024:.2f} GiB is usable; free memory, use a card with at least "
                f"{self.needed_mib / 1024:.2f} GiB, or use a smaller model.")


# changes after which a saved state no longer matches the network/optimizer shapes
_STATE_BREAKING = {"network_dim", "optimizer_type", "cache_text_encoder_outputs"}


def rescale_factor(predicted_failed_mib: float, measured_mib: float | None, budget_mib: float) -> float:
    """measured / predicted for the failed settings, ties the model to this machine.

    The failed attempt needed more than the budget and at least what was measured before it failed,
    so the evidence is max(measured, budget x 1.02); the rescaled prediction of the failed settings
    is therefore always over budget. The factor may be below 1 (a model in other units, or one that
    over-predicts, e.g. tensor bytes against a CPU process's resident memory).
    """
    if predicted_failed_mib <= 0:
        return 1.0
    evidence = max(measured_mib or 0.0, budget_mib * 1.02)
    return evidence / predicted_failed_mib


def _rungs(settings: TrainSettings, limits: LadderLimits) -> list[tuple[str, list[TrainSettings], str]]:
    """Each rung of the OOM policy: (title, candidate settings mildest first, why) (``facts.settings_space``)."""
    return [(rung.title, [c.settings for c in candidates], rung.why)
            for _, rung, candidates in rungs(settings, OOM_POLICY, limits)]


def _changes(old: TrainSettings, new: TrainSettings) -> dict[str, tuple[Any, Any]]:
    return new.changed_from(old)


def next_settings(
    failed: TrainSettings,
    limits: LadderLimits,
    predict: Callable[[TrainSettings], float],
    measured_mib: float | None = None,
    tried: Sequence[TrainSettings] = (),
) -> Decision | Exhausted:
    """Pick the next configuration predicted to fit after ``failed`` ran out of memory.

    ``tried`` are settings that already failed (never proposed again). Returns a :class:`Decision`,
    or :class:`Exhausted` with the smallest configuration and its predicted need.
    """
    scale = rescale_factor(predict(failed), measured_mib, limits.budget_mib)
    tried_set = set(tried) | {failed}
    current = failed
    reasons: list[str] = []
    walked: list[str] = []
    for name, candidates, why in _rungs(failed, limits):
        # rebuild the rung's candidates on top of what earlier rungs already applied
        rung_candidates = [_apply(current, failed, cand) for cand in candidates]
        if not rung_candidates:
            continue
        for cand in rung_candidates:
            predicted = predict(cand) * scale
            if predicted <= limits.budget_mib and cand not in tried_set:
                change = _changes(current, cand)
                return Decision(
                    settings=cand,
                    changes=_changes(failed, cand),
                    reasons=(*reasons, _reason(name, why, change)),
                    predicted_mib=predicted,
                    scale=scale,
                    resume_compatible=not (_STATE_BREAKING & set(_changes(failed, cand))),
                )
        strongest = rung_candidates[-1]
        reasons.append(_reason(name, why, _changes(current, strongest)))
        walked.append(f"{name} ({_short(_changes(current, strongest))})")
        current = strongest
    return Exhausted(floor=current, needed_mib=predict(current) * scale, budget_mib=limits.budget_mib,
                     tried=tuple(walked), scale=scale)


def _apply(current: TrainSettings, failed: TrainSettings, candidate: TrainSettings) -> TrainSettings:
    """Carry the fields a rung candidate changed (relative to ``failed``) onto ``current``."""
    return replace(current, **{k: new for k, (_, new) in _changes(failed, candidate).items()})


def _short(change: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{k} {old}->{new}" for k, (old, new) in change.items())


def _reason(name: str, why: str, change: dict[str, tuple[Any, Any]]) -> str:
    return f"{name}: {_short(change)} ({why})"


def memory_predictor(family: FamilySpec, *, text_encoder_outputs_cached: bool = False, cuda: bool = True,
                     memory: MemoryView = AS_MODELLED, processes: int = 1) -> Callable[[TrainSettings], float]:
    """``predict(settings) -> MiB`` from the analytic memory model, for :func:`next_settings`.

    ``text_encoder_outputs_cached``: the engine caches them whatever the settings say (it does so for a
    frozen text encoder with fixed captions), so the text encoders are off the device.

    On CPU (``cuda=False``) the CUDA context and the safety margin are left out: they are constants
    that would hide the differences between rungs; the measured/predicted rescaling in
    :func:`next_settings` is what ties the figures to this machine. ``memory``: an emulated card's view, a
    deliberately scaled model (``MemoryView``); ``processes``: what a sharded denoiser (``fsdp``) is split across.
    """
    from autotune.estimate.dit_memory import dit_inputs_for_settings, is_dit_family, predict_dit_memory
    from autotune.estimate.memory_model import (
        DEFAULT_CUDA_CONTEXT_GIB,
        DEFAULT_SAFETY_MARGIN_GIB,
        family_calibration,
        inputs_for_settings,
        predict_memory,
    )

    context, margin = (DEFAULT_CUDA_CONTEXT_GIB, DEFAULT_SAFETY_MARGIN_GIB) if cuda else (0.0, 0.0)
    rules = "cuda" if cuda else "cpu"  # whose autocast op lists the coefficients were traced under
    if is_dit_family(family):  # training phase: an OOM in training comes after the text-encoder caching
        return lambda s: memory.predict(predict_dit_memory, replace(
            dit_inputs_for_settings(family, s, processes=processes), cuda_context_gib=context,
            safety_margin_gib=margin, autocast_rules=rules,
            cache_text_encoder_outputs=s.cache_text_encoder_outputs or text_encoder_outputs_cached)
        ).training_total_bytes / 2**20
    family_calibration(family.name)  # an uncalibrated family fails here, with the fix, not at the first OOM

    def predict(s: TrainSettings) -> float:
        inputs = inputs_for_settings(family, s, text_encoder_outputs_cached=text_encoder_outputs_cached,
                                     processes=processes)
        return memory.predict(predict_memory, replace(inputs, cuda_context_gib=context, safety_margin_gib=margin,
                                                      autocast_rules=rules)).total_bytes / 2**20

    return predict
