"""A user's values on top of the plan, re-predicted: does it still fit, and if not, what would.

Values that the planner takes as preferences (rank, resolution, optimizer, epochs, text-encoder training)
go back through ``plan_training``, so everything that follows from them (alpha, bucket limits, learning
rates, the step count) stays the planner's rule. The planner can honour a preference only where it fits:
when it had to give the value up, the plan is made again for the same card with unbounded memory (its
rules, the user's values, nothing given up) and the real card's prediction decides.

Values the planner chooses without a preference (micro-batch, accumulation, precision, gradient
checkpointing) are set on the plan's choices directly and predicted with the memory and speed models, the
same way the planner predicts (``inputs_for_settings`` is the mapping the planner and the OOM ladder use);
what follows from them (effective batch, learning rate, warm-up, steps, the dataset.toml batch, the launch
command's precision) is set to match.

Settings are read through ``plan.kohya_values()`` (kohya's keys) with the settings space's one reader and held
as ``TrainSettings`` (kohya's names); the changes it suggests are the space's moves in the wizard's policy
(``one_knob_changes``), the same moves the planner and the OOM ladder make.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from autotune.planning.goals import network_alpha
from autotune.planning.planner import (
    DDP_EFFICIENCY,
    GIB,
    GOAL_PROFILES,
    RESOLUTION_STEP,
    Choice,
    Plan,
    PlanRequest,
    Prediction,
    Preferences,
    learned_for,
    learning_rate,
    plan_training,
)
from autotune.planning.resolution import MIN_BUCKET_RESO
from sd_scripts_compat.facts.families import FamilySpec
from sd_scripts_compat.facts.settings import TrainSettings
from sd_scripts_compat.facts.settings_space import (
    Limits,
    Policy,
    rungs,
    settings_from_values,
    with_dataset_values,
)

UNBOUNDED_BYTES = 1 << 50  # "memory is no object": the planner keeps every preference
# Override field -> the planner preference it maps onto.
PREFERENCE_OF = {"network_dim": "rank", "resolution": "resolution", "optimizer_type": "optimizer",
                 "max_train_epochs": "epochs", "train_text_encoder": "train_text_encoder"}


@dataclass(frozen=True)
class Overrides:
    """What the user set (None: the planner's choice). Field names are kohya's where kohya has one."""

    train_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None
    network_dim: int | None = None
    resolution: int | None = None
    max_train_epochs: int | None = None
    optimizer_type: str | None = None
    mixed_precision: str | None = None
    gradient_checkpointing: bool | None = None
    train_text_encoder: bool | None = None

    def pinned(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if value is not None}

    def merged(self, other: Overrides) -> Overrides:
        return replace(self, **other.pinned())


@dataclass(frozen=True)
class Target:
    """What a prediction needs besides the settings: the family, the devices and the data."""

    family: FamilySpec
    gpus: tuple[Any, ...]
    cpu_cores: int
    usable_bytes: int
    views_per_epoch: int
    cpu_bf16: bool = False  # the CPU computes bf16 natively (the plan's request)
    t5_fp8: bool = False  # FLUX: the plan names an fp8 T5-XXL file (HunyuanImage: fp8_vl)
    te_cpu: bool = False  # HunyuanImage: the plan caches on the CPU (text_encoder_cpu)
    learned: Any = field(default=None, compare=False)  # this machine's measurements, as `autotune plan` reads them

    @classmethod
    def of(cls, request: PlanRequest, plan: Plan) -> Target:
        assert plan.prediction is not None and plan.dataset is not None, "a fitting plan"
        return cls(family=plan.family, gpus=tuple(request.gpus),
                   cpu_cores=request.cpu_physical_cores, usable_bytes=plan.prediction.usable_bytes,
                   views_per_epoch=plan.dataset.views_per_epoch,
                   t5_fp8=_te_flag(plan, "fp8"), te_cpu=_te_flag(plan, "cpu"), cpu_bf16=request.cpu_bf16,
                   learned=learned_for(request, plan.family, max(1, len(request.gpus))))

    @property
    def devices(self) -> int:
        return max(1, len(self.gpus))


def _te_flag(plan: Plan, form: str) -> bool:
    """Whether the plan caches with its largest text encoder in fp8 (an fp8 T5-XXL file, or the family's flag) or
    on the CPU (the family's flag)."""
    from autotune.planning.profiles import plan_profile

    values, profile = plan.kohya_values(), plan_profile(plan.family)
    if form == "cpu":
        return bool(profile.te_cpu_flag and values.get(profile.te_cpu_flag))
    return "fp8" in str(values.get("t5xxl", "")) or bool(profile.te_fp8_flag and values.get(profile.te_fp8_flag))


@dataclass(frozen=True)
class Fit:
    """The prediction of one configuration on the target."""

    peak_bytes: int
    required_bytes: int  # peak + the memory model's safety margin
    usable_bytes: int
    components: tuple[tuple[str, int], ...]
    micro_steps_per_s: float
    samples_per_s: float
    seconds_per_step: float
    optimizer_steps: int
    speed_basis: str = "speed model"  # or the measured run it comes from

    @property
    def fits(self) -> bool:
        return self.required_bytes <= self.usable_bytes

    @property
    def it_per_s(self) -> float:
        return 1.0 / self.seconds_per_step

    @property
    def total_seconds(self) -> float:
        return self.optimizer_steps * self.seconds_per_step

    def prediction(self) -> Prediction:
        return Prediction(peak_bytes=self.peak_bytes, required_bytes=self.required_bytes,
                          usable_bytes=self.usable_bytes, components=self.components, it_per_s=self.it_per_s,
                          micro_steps_per_s=self.micro_steps_per_s, samples_per_s=self.samples_per_s,
                          seconds_per_step=self.seconds_per_step, total_seconds=self.total_seconds,
                          optimizer_steps=self.optimizer_steps)


@dataclass(frozen=True)
class Suggestion:
    """A change that would fit: shown to the user, applied by merging ``overrides``."""

    label: str
    overrides: Overrides
    fit: Fit


@dataclass(frozen=True)
class Evaluation:
    overrides: Overrides
    plan: Plan  # the planned files with the user's values; written only when ``fits``
    settings: TrainSettings
    fit: Fit
    suggestions: tuple[Suggestion, ...]
    notes: tuple[str, ...]

    @property
    def fits(self) -> bool:
        return self.fit.fits


# ------------------------------------------------------------------------------------------ settings


def predict_fit(target: Target, settings: TrainSettings, epochs: int) -> Fit:
    """Memory on one device and the slowest device's speed, as the planner predicts them (its ``Predictor``:
    this machine's measured figures where the store has them)."""
    from autotune.planning.search import Predictor

    predictor = Predictor(target.family, target.gpus, target.cpu_cores, t5_fp8=target.t5_fp8,
                          te_cpu=target.te_cpu,
                          cpu_bf16=target.cpu_bf16, learned=target.learned, usable=target.usable_bytes)
    estimate = predictor.predict(settings)
    micro = float(estimate.it_per_s)
    batch, accumulation = settings.train_batch_size, settings.gradient_accumulation_steps
    scale = target.devices * (DDP_EFFICIENCY if target.devices > 1 else 1.0)
    steps = epochs * math.ceil(target.views_per_epoch / (batch * accumulation * target.devices))
    return Fit(peak_bytes=estimate.peak, required_bytes=estimate.required, usable_bytes=target.usable_bytes,
               components=estimate.components, micro_steps_per_s=micro, samples_per_s=micro * batch * scale,
               seconds_per_step=accumulation / micro, optimizer_steps=steps, speed_basis=estimate.speed_basis)


def with_preference_values(settings: TrainSettings, overrides: Overrides, is_sdxl: bool) -> TrainSettings:
    """``settings`` with the preference-mapped overrides forced in (alpha = rank / 2, as the planner sets it)."""
    out = settings
    if overrides.network_dim is not None:
        out = replace(out, network_dim=overrides.network_dim, network_alpha=network_alpha(overrides.network_dim))
    if overrides.resolution is not None:
        size = overrides.resolution
        out = replace(out, resolution=(size, size), max_bucket_reso=2 * size if out.max_bucket_reso else None)
    if overrides.optimizer_type is not None:
        out = replace(out, optimizer_type=overrides.optimizer_type)
    if overrides.train_text_encoder is not None:
        train = overrides.train_text_encoder
        out = replace(out, network_train_unet_only=not train, cache_text_encoder_outputs=is_sdxl and not train)
    return out


def with_direct_values(settings: TrainSettings, overrides: Overrides) -> TrainSettings:
    changes = {key: getattr(overrides, key) for key in ("train_batch_size", "gradient_accumulation_steps",
                                                        "mixed_precision", "gradient_checkpointing")
               if getattr(overrides, key) is not None}
    return replace(settings, **changes)


# ------------------------------------------------------------------------------------------ evaluate


def evaluate(request: PlanRequest, base: Plan, overrides: Overrides) -> Evaluation:
    """The plan with ``overrides`` applied, its prediction, and (when it does not fit) what would."""
    target = Target.of(request, base)
    prefs = preferences_with(request.preferences, overrides)
    real = base if prefs == request.preferences else plan_training(replace(request, preferences=prefs))
    honoured = real.fits and honours(real, overrides)
    template = real if honoured else plan_training(_unbounded(request, prefs))
    wanted = with_preference_values(settings_from_values(template.kohya_values()), overrides, target.family.is_sdxl)
    if not honoured:
        # The knobs the user left to the planner: its choice where it found one, else the smallest.
        known = settings_from_values(real.kohya_values()) if real.fits else None
        effective = wanted.train_batch_size * wanted.gradient_accumulation_steps
        wanted = replace(wanted, train_batch_size=known.train_batch_size if known else 1,
                         gradient_accumulation_steps=known.gradient_accumulation_steps if known else effective,
                         gradient_checkpointing=known.gradient_checkpointing if known else True,
                         fp8_base=known.fp8_base if known else False)
    wanted = with_direct_values(wanted, overrides)
    epochs = int(template.kohya_values()["max_train_epochs"])
    fit = predict_fit(target, wanted, epochs)
    plan = template
    if not honoured or wanted != settings_from_values(template.kohya_values()):
        plan = edit_plan(template, wanted, fit, device=base.device, pinned=overrides.pinned())
    suggestions = () if fit.fits else suggest(request, base, target, wanted, epochs, overrides,
                                              real if real.fits and not honoured else None)
    return Evaluation(overrides=overrides, plan=plan, settings=wanted, fit=fit, suggestions=suggestions,
                      notes=notes_for(target, wanted, real if honoured else None, base))


def preferences_with(prefs: Preferences, overrides: Overrides) -> Preferences:
    changes = {PREFERENCE_OF[key]: value for key, value in overrides.pinned().items() if key in PREFERENCE_OF}
    return replace(prefs, **changes)


def honours(plan: Plan, overrides: Overrides) -> bool:
    """Whether a (fitting) plan kept every preference-mapped value the user set."""
    values = plan.kohya_values()
    settings = settings_from_values(values)
    checks = [
        (overrides.network_dim, settings.network_dim),
        (None if overrides.resolution is None else (overrides.resolution, overrides.resolution), settings.resolution),
        (overrides.optimizer_type, settings.optimizer_type),
        (overrides.max_train_epochs, values.get("max_train_epochs")),
        (overrides.train_text_encoder, not settings.network_train_unet_only),
    ]
    return all(wanted is None or wanted == got for wanted, got in checks)


def _unbounded(request: PlanRequest, prefs: Preferences) -> PlanRequest:
    """The same request on cards (or a CPU) with unbounded memory: every preference is kept."""
    gpus = tuple(replace(gpu, total_bytes=UNBOUNDED_BYTES, held_bytes=0) for gpu in request.gpus)
    return replace(request, gpus=gpus, preferences=prefs, cpu_memory_bytes=UNBOUNDED_BYTES)


# ------------------------------------------------------------------------------------------ edit


def edit_plan(template: Plan, settings: TrainSettings, fit: Fit, *, device: str, pinned: dict[str, Any]) -> Plan:
    """``template`` with the direct knobs of ``settings`` set, and what follows from them."""
    values = template.kohya_values()
    old = settings_from_values(values)
    effective = settings.train_batch_size * settings.gradient_accumulation_steps * template.num_processes
    steps = fit.optimizer_steps
    choices = _Choices(template.choices)
    yours = "your value" if "train_batch_size" in pinned else "kept from the plan"
    choices.set("train_batch_size", settings.train_batch_size,
                f"{yours}: predicted peak {fit.peak_bytes / GIB:.2f} GiB of {fit.usable_bytes / GIB:.2f} GiB usable "
                "per device")
    devices = f" x {template.num_processes} devices" if template.num_processes > 1 else ""
    choices.set("gradient_accumulation_steps", settings.gradient_accumulation_steps,
                f"{'your value; ' if 'gradient_accumulation_steps' in pinned else ''}effective batch {effective} = "
                f"{settings.train_batch_size} x {settings.gradient_accumulation_steps}{devices}")
    choices.set("effective_batch", effective)
    if settings.gradient_checkpointing != old.gradient_checkpointing or "gradient_checkpointing" in pinned:
        choices.set("gradient_checkpointing", settings.gradient_checkpointing,
                    "your value: recomputes activations in backward (~30% slower, far less memory)"
                    if settings.gradient_checkpointing else "your value: off (faster, activations kept in memory)")
    if settings.fp8_base != old.fp8_base:
        if settings.fp8_base:
            choices.insert_after("mixed_precision", Choice("fp8_base", True, "the planner's fit: frozen base "
                                                                            "weights stored in fp8"))
        else:
            choices.drop("fp8_base")
    launch = template.launch_command
    if settings.mixed_precision != old.mixed_precision:
        choices.set("mixed_precision", settings.mixed_precision,
                    f"your value (the planner chose {old.mixed_precision})")
        launch = _launch_with_precision(launch, settings.mixed_precision)
    if template.family.is_sdxl and settings.mixed_precision == "fp16":
        if "no_half_vae" not in values:
            choices.insert_after("mixed_precision", Choice("no_half_vae", True, "SDXL's VAE overflows in fp16"))
    else:
        choices.drop("no_half_vae")
    if values.get("optimizer_type") != "Prodigy":
        rate = learning_rate(GOAL_PROFILES[template.goal], effective)
        choices.set("learning_rate", rate)
        choices.set("unet_lr", rate, f"goal {template.goal}: rate scaled by sqrt(effective batch {effective} / 4)")
        if "text_encoder_lr" in values:
            choices.set("text_encoder_lr", [float(f"{rate / 2:.3g}")])
    choices.set("lr_warmup_steps", int(round(0.05 * steps)), f"5% of {steps} steps")
    epochs = values["max_train_epochs"]
    choices.set("max_train_epochs", epochs, f"{'your value: ' if 'max_train_epochs' in pinned else ''}{epochs} "
                f"epoch(s) of {fit.optimizer_steps // max(1, epochs)} optimizer steps at effective batch {effective}")
    dataset_config = with_dataset_values(template.dataset_config, settings, base=old)
    message = (f"{template.family.name} on {device}: micro-batch {settings.train_batch_size} x accumulation "
               f"{settings.gradient_accumulation_steps}, predicted peak {fit.peak_bytes / GIB:.2f} of "
               f"{fit.usable_bytes / GIB:.2f} GiB usable")
    return replace(template, fits=fit.fits, message=message, device=device, choices=choices.done(),
                   dataset_config=dataset_config, prediction=fit.prediction(), launch_command=launch)


class _Choices:
    """An editable copy of a plan's choices that keeps their order."""

    def __init__(self, choices: tuple[Choice, ...]) -> None:
        self.items = list(choices)

    def _index(self, key: str) -> int | None:
        return next((i for i, choice in enumerate(self.items) if choice.key == key), None)

    def set(self, key: str, value: Any, reason: str | None = None) -> None:
        index = self._index(key)
        if index is not None:
            old = self.items[index]
            self.items[index] = replace(old, value=value, reason=old.reason if reason is None else reason)

    def insert_after(self, key: str, choice: Choice) -> None:
        if self._index(choice.key) is None:
            index = self._index(key)
            self.items.insert(len(self.items) if index is None else index + 1, choice)

    def drop(self, key: str) -> None:
        self.items = [choice for choice in self.items if choice.key != key]

    def done(self) -> tuple[Choice, ...]:
        return tuple(self.items)


def _launch_with_precision(command: tuple[str, ...], precision: str) -> tuple[str, ...]:
    """accelerate's ``--mixed_precision`` follows the config's (absent for fp32)."""
    words = list(command)
    if "--mixed_precision" in words:
        at = words.index("--mixed_precision")
        del words[at:at + 2]
    if precision in ("fp16", "bf16"):
        at = words.index("--num_cpu_threads_per_process") if "--num_cpu_threads_per_process" in words else 2
        words[at:at] = ["--mixed_precision", precision]
    return tuple(words)


# ------------------------------------------------------------------------------------------ advice


def suggest(request: PlanRequest, base: Plan, target: Target, wanted: TrainSettings, epochs: int,
            overrides: Overrides, planner_fit: Plan | None, limit: int = 3) -> tuple[Suggestion, ...]:
    """Changes that would fit, mildest first: the planner's own fit for the user's preferences, then one
    knob each (checkpointing, a smaller micro-batch at the same effective batch, 8-bit optimizer, UNet only,
    a lower rank, a lower resolution), each at its mildest fitting value."""
    out: list[Suggestion] = []
    if planner_fit is not None:
        got = settings_from_values(planner_fit.kohya_values())
        change: dict[str, Any] = {}
        if overrides.network_dim is not None:
            change["network_dim"] = got.network_dim
        if overrides.resolution is not None:
            change["resolution"] = got.resolution[0]
        if overrides.optimizer_type is not None:
            change["optimizer_type"] = got.optimizer_type
        if overrides.train_text_encoder is not None:
            change["train_text_encoder"] = not got.network_train_unet_only
        # The user's preferences at the values the planner could keep; batch and checkpointing its own again.
        fresh = replace(overrides, train_batch_size=None, gradient_accumulation_steps=None,
                        gradient_checkpointing=None, **change)
        given_up = ", ".join(planner_fit.fallbacks) or describe(Overrides(**change))
        out.append(Suggestion(f"the planner's fit: {given_up}", fresh, predict_fit(target, got, epochs)))
    for candidates in one_knob_changes(target, wanted):
        for knob, settings in candidates:
            fit = predict_fit(target, settings, epochs)
            if fit.fits:
                merged = overrides.merged(knob)
                if all(merged != known.overrides for known in out):
                    out.append(Suggestion(describe(knob), merged, fit))
                break
    return tuple(out[:limit])


WIZARD_RUNGS = ("checkpointing", "micro_batch", "optimizer", "unet_only", "rank_min", "resolution")


def one_knob_changes(target: Target, wanted: TrainSettings) -> list[list[tuple[Overrides, TrainSettings]]]:
    """Per knob, its candidate values mildest first (the caller keeps the first that fits): the settings space's
    moves in the wizard's policy (one knob at a time from the user's values; alpha = rank / 2, buckets twice the
    side, resolution only for full-size families), each told back as the override that makes it."""
    policy = Policy(rungs=WIZARD_RUNGS if not target.family.tiny else WIZARD_RUNGS[:-1], exact_micro_batches=False,
                    switch_optimizer=True, alpha=network_alpha, bucket_follows="double")
    limits = Limits(is_sdxl=target.family.is_sdxl, resolution_step=RESOLUTION_STEP, min_resolution=MIN_BUCKET_RESO)
    out = []
    for _, _, candidates in rungs(wanted, policy, limits):
        out.append([(overrides_for(wanted, c.settings), c.settings) for c in candidates])
    return [knob for knob in out if knob]


def overrides_for(base: TrainSettings, new: TrainSettings) -> Overrides:
    """The user's override that turns ``base`` into ``new`` (kohya's fields; UNet-only as train_text_encoder)."""
    change = {key: value for key, (_, value) in new.changed_from(base).items() if key in _OVERRIDABLE}
    if "resolution" in change:
        change["resolution"] = new.resolution[0]
    if "network_train_unet_only" in change:
        change["train_text_encoder"] = not change.pop("network_train_unet_only")
    return Overrides(**change)


_OVERRIDABLE = {"train_batch_size", "gradient_accumulation_steps", "gradient_checkpointing", "optimizer_type",
                "network_dim", "resolution", "network_train_unet_only"}


LABELS = {"train_batch_size": "micro-batch", "gradient_accumulation_steps": "accumulation", "network_dim": "rank",
          "resolution": "resolution", "max_train_epochs": "epochs", "optimizer_type": "optimizer",
          "mixed_precision": "precision", "gradient_checkpointing": "gradient checkpointing",
          "train_text_encoder": "train the text encoder"}


def describe(overrides: Overrides) -> str:
    """``micro-batch 2, accumulation 4``; booleans as on / off."""
    parts = []
    for knob in fields(Overrides):
        value = getattr(overrides, knob.name)
        if value is None:
            continue
        shown = ("on" if value else "off") if isinstance(value, bool) else str(value)
        parts.append(f"{LABELS[knob.name]} {shown}")
    return ", ".join(parts) or "the planner's choices"


def notes_for(target: Target, settings: TrainSettings, real: Plan | None, base: Plan) -> tuple[str, ...]:
    """Warnings that are not about memory: a precision the device lacks, what the planner gave up to keep
    the user's values."""
    notes = []
    if settings.mixed_precision == "bf16":
        if target.gpus and not all(gpu.bf16_capable for gpu in target.gpus):
            notes.append("bf16 needs compute capability 8.0 or newer; this card would emulate it slowly or "
                         "refuse it (fp16 is the planner's choice)")
        if not target.gpus and not target.cpu_bf16:  # said as the plan says it (speed_model.cpu_bf16_speed)
            from autotune.estimate.speed_model import cpu_bf16_speed

            notes.append(f"{cpu_bf16_speed(False)} (the planner's choice is no)")
    if settings.mixed_precision == "no" and target.gpus:
        notes.append("fp32 on a GPU: twice the weight memory and far slower than bf16 / fp16")
    if real is not None and real.fallbacks and real.fallbacks != base.fallbacks:
        notes.append("to keep your values the planner gave up: " + ", ".join(real.fallbacks))
    return tuple(notes)
