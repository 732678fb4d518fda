"""The plan as a table with each choice's reason, the predicted peak memory drawn against the usable memory,
it/s and total time; then the user may change any value, and every change is predicted again.

A change that would not fit is flagged with what would (``overrides.suggest``), and such a plan cannot be
accepted: the wizard writes only configurations predicted to fit (``autotune run`` would still step down
if the prediction were wrong). Under ``--yes`` the flags' values are the changes; one that does not fit
is a one-line error naming what would.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autotune.wizard.ask import Asker, Option, integer_check
from autotune.wizard.overrides import LABELS, Evaluation, Overrides, describe, evaluate
from sd_scripts_compat.facts.errors import UserError

if TYPE_CHECKING:
    from autotune.planning.planner import Plan
    from autotune.planning.request import PlanRequest

GIB = 1024**3
BAR_WIDTH = 40
# The rows of the table: the values a user weighs (the files hold every key, each with its reason).
SHOWN = ("resolution", "train_batch_size", "gradient_accumulation_steps", "gradient_checkpointing", "network_dim",
         "network_train_unet_only", "optimizer_type", "unet_lr", "mixed_precision", "fp8_base",
         "cache_text_encoder_outputs", "max_train_epochs")
# Table row -> the override it is changed through.
KNOB_OF_KEY = {"train_batch_size": "train_batch_size", "gradient_accumulation_steps": "gradient_accumulation_steps",
               "network_dim": "network_dim", "resolution": "resolution", "max_train_epochs": "max_train_epochs",
               "optimizer_type": "optimizer_type", "mixed_precision": "mixed_precision",
               "gradient_checkpointing": "gradient_checkpointing", "network_train_unet_only": "train_text_encoder"}


def review(asker: Asker, request: PlanRequest, base: Plan, start: Overrides, accept: bool = False) -> Evaluation:
    """Show, change, re-predict until the user accepts a fitting plan; returns that evaluation.
    ``accept`` (``--accept``) answers the first "Next" question as ``--yes`` would."""
    current = evaluate(request, base, start)
    while True:
        show(asker, current)
        if asker.assume_yes or accept:
            if not current.fits:
                raise UserError(_flag_error(current))
            asker.say(f"Plan accepted ({'--yes' if asker.assume_yes else '--accept'}).")
            return current
        options: list[Option[str | int]] = []  # an int: the suggestion of that index
        if current.fits:
            options.append(Option("accept: write the files", "accept"))
        options += [Option(f"use: {s.label} (peak {s.fit.peak_bytes / GIB:.2f} GiB)", i)
                    for i, s in enumerate(current.suggestions)]
        options.append(Option("change a value", "change"))
        if current.overrides.pinned():
            options.append(Option("undo my changes (the planner's plan)", "undo"))
        default = options[0].value
        action = asker.choose("Next", options, default=default,
                              explanation="any change is predicted again before anything is written")
        if action == "accept":
            return current
        if action == "undo":
            current = evaluate(request, base, Overrides())
        elif action == "change":
            change = ask_change(asker, current, request, base)
            current = evaluate(request, base, current.overrides.merged(change))
        elif isinstance(action, int):
            current = evaluate(request, base, current.suggestions[action].overrides)


def show(asker: Asker, current: Evaluation) -> None:
    from rich.markup import escape
    from rich.table import Table

    plan, pinned = current.plan, current.overrides.pinned()
    values = {choice.key: choice for choice in plan.choices}
    title = f"Plan: {plan.family.name} on {plan.device}, goal {plan.goal}, priority {plan.priority}"
    table = Table(title=escape(title),
                  title_justify="left", show_edge=False, pad_edge=False, expand=False)
    table.add_column("setting", style="cyan", no_wrap=True)
    table.add_column("value", no_wrap=True)
    table.add_column("why")
    for key in SHOWN:
        choice = values.get(key)
        if choice is None:
            continue
        mine = KNOB_OF_KEY.get(key) in pinned
        shown = escape(_value_text(choice.value))
        table.add_row(key, f"[bold yellow]{shown} *[/bold yellow]" if mine else f"[bold]{shown}[/bold]",
                      escape(choice.reason))
    asker.console.print(table)
    if pinned:
        asker.say("  * your value")
    fit = current.fit
    asker.console.print(memory_line(fit.peak_bytes, fit.required_bytes, fit.usable_bytes, cpu=plan.device == "CPU"),
                        highlight=False)
    from autotune.planning.toml_writer import human_seconds

    basis = fit.speed_basis
    asker.say(f"  speed   {fit.it_per_s:.3g} it/s (kohya's progress bar), {fit.optimizer_steps} steps: about "
              f"{human_seconds(fit.total_seconds)} (predicted from: {basis})")
    for note in current.notes:
        asker.say(f"  note: {note}", style="yellow")
    if not current.fits:
        asker.say(f"  ✗ does not fit: {fit.required_bytes / GIB:.2f} GiB needed (peak + safety margin) > "
                  f"{fit.usable_bytes / GIB:.2f} GiB usable", style="bold red")
        if current.suggestions:
            asker.say("  would fit: " + "; ".join(f"{s.label} (peak {s.fit.peak_bytes / GIB:.2f} GiB)"
                                                  for s in current.suggestions), style="red")
        else:
            asker.say("  nothing close fits; undo your changes", style="red")


def _value_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ", ".join(str(v) for v in value)
    return str(value)


def memory_line(peak: int, required: int, usable: int, cpu: bool = False) -> str:
    """``VRAM [█████▒▒░░░░░]  5.2 GiB peak (+0.5 margin) of 11.2 GiB usable``; the bar's scale is the larger
    of need and usable, and a ``|`` marks the usable end when the need runs past it."""
    scale = max(usable, required, 1)
    cells = [round(peak / scale * BAR_WIDTH), round(required / scale * BAR_WIDTH), round(usable / scale * BAR_WIDTH)]
    p, r, u = cells[0], max(cells[0], cells[1]), min(BAR_WIDTH, cells[2])
    bar = "█" * p + "▒" * (r - p) + "░" * (BAR_WIDTH - r)
    if required > usable:
        bar = bar[:u] + "|" + bar[u + 1:]
    colour = "green" if required <= 0.85 * usable else "yellow" if required <= usable else "red"
    label = "RAM " if cpu else "VRAM"
    return (f"  {label}    [{colour}]{bar}[/{colour}]  {peak / GIB:.2f} GiB peak (+{(required - peak) / GIB:.2f} "
            f"margin) of {usable / GIB:.2f} GiB usable")


# ------------------------------------------------------------------------------------------ changes


def knob_problem(knob: str, value: Any, family_tiny: bool, on_gpu: bool) -> str | None:
    """Why a value cannot be set, or None; the same rules for a typed value and a flag's."""
    from autotune.planning.planner import RESOLUTION_STEP
    from sd_scripts_compat.facts.optimizers import optimizer_names

    if knob == "resolution":
        if family_tiny:
            return "the tiny test families train at their native size only"
        if value < 256 or value % RESOLUTION_STEP or value > 4096:
            return f"must be a multiple of {RESOLUTION_STEP} from 256 to 4096"
    if knob == "optimizer_type" and value not in optimizer_names():  # every one `autotune plan` / `run` take
        return f"choose one of {', '.join(optimizer_names())}"
    if knob == "mixed_precision" and value not in precisions(on_gpu):
        return f"choose one of {', '.join(precisions(on_gpu))}"
    return None


def precisions(on_gpu: bool) -> tuple[str, ...]:
    return ("bf16", "fp16", "no") if on_gpu else ("no", "bf16")


def ask_change(asker: Asker, current: Evaluation, request: PlanRequest, base: Plan) -> Overrides:
    """Which value, then the new value; returns the one-field change."""
    from sd_scripts_compat.facts.optimizers import optimizer_names

    values = {choice.key: choice.value for choice in current.plan.choices}
    settings = current.settings
    shown = {"train_batch_size": settings.train_batch_size,
             "gradient_accumulation_steps": settings.gradient_accumulation_steps, "network_dim": settings.network_dim,
             "resolution": settings.resolution[0], "max_train_epochs": values.get("max_train_epochs"),
             "optimizer_type": settings.optimizer_type, "mixed_precision": settings.mixed_precision,
             "gradient_checkpointing": settings.gradient_checkpointing,
             "train_text_encoder": not settings.network_train_unet_only}
    def text_of(value: Any) -> str:
        return ("on" if value else "off") if isinstance(value, bool) else str(value)


    tiny = current.plan.family.tiny
    if tiny:
        del shown["resolution"]  # the tiny test families train at their native size only
    knob = asker.choose("Which value?", [Option(f"{LABELS[k]}: {text_of(v)}", k) for k, v in shown.items()],
                        default="train_batch_size")
    old = shown[knob]
    on_gpu = bool(request.gpus)
    if knob in ("gradient_checkpointing", "train_text_encoder"):
        new: bool | int | str = asker.choose(f"{LABELS[knob]}", [Option("on", True), Option("off", False)],
                                             default=not old)
    elif knob == "optimizer_type":
        new = asker.choose("optimizer", [Option(name, name) for name in optimizer_names()],
                           default=settings.optimizer_type)
    elif knob == "mixed_precision":
        precision = settings.mixed_precision
        new = asker.choose("precision", [Option(name, name) for name in precisions(on_gpu)],
                           default=precision if precision in precisions(on_gpu) else precisions(on_gpu)[0])
    else:
        limits = {"train_batch_size": (1, 64), "gradient_accumulation_steps": (1, 256), "network_dim": (1, 1024),
                  "resolution": (256, 4096), "max_train_epochs": (1, 10000)}[knob]
        number = integer_check(*limits)

        def check(text: str) -> str | None:
            return number(text) or knob_problem(knob, int(text.strip()), tiny, on_gpu)

        new = int(asker.text(f"{LABELS[knob]} (now {old})", default=str(old), check=check))
    pinned: dict[str, Any] = {knob: new}  # the knob the user picked: a field of Overrides (LABELS' keys)
    return Overrides(**pinned)


def _flag_error(current: Evaluation) -> str:
    fit = current.fit
    advice = "; ".join(s.label for s in current.suggestions) or "drop the value flags (the planner's plan fits)"
    return (f"{describe(current.overrides)}: does not fit ({fit.required_bytes / GIB:.2f} GiB needed with the "
            f"safety margin, {fit.usable_bytes / GIB:.2f} GiB usable); would fit: {advice}")
