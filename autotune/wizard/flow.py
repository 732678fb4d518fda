"""The wizard from the first question to the last: hardware, model, dataset, goal and output, the plan
review, then the end: config.toml + dataset.toml, the commands that use them, and ``autotune run``.

Nothing is written before the end. There the organised dataset (if any) and the two configs are written
with Ctrl-C held back until they are all on disk (each file is atomic; held back, the set is too).
Training starts in this process through the function ``autotune run`` itself calls
(``autotune.launch.run.start_run``), with the options of the command line printed just above it parsed by the
same declarations: the same checks, no second interpreter start-up, and Ctrl-C reaches the watchdog, which saves
state and prints how to resume.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.wizard import steps
from autotune.wizard.answers import check_flags, overrides_from_args
from autotune.wizard.ask import Asker
from sd_scripts_compat.facts.errors import UserError

if TYPE_CHECKING:
    from rich.console import Console

    from autotune.planning.planner import Plan
    from autotune.planning.request import PlanRequest


def run_wizard(args: argparse.Namespace, console: Console | None = None) -> int:
    from rich.console import Console

    from autotune.planning.planner import plan_training
    from autotune.wizard.review import review

    check_flags(args)
    asker = Asker(console or Console(highlight=False), assume_yes=args.yes)
    asker.say("[bold]autotune wizard[/bold]: a few questions, then a plan that fits your GPU. "
              "Ctrl-C quits and writes nothing.", markup=True)
    hardware = steps.hardware(asker, args)
    model = steps.base_model(asker, args)
    experts = steps.experts(asker, args, model.family)
    data = steps.dataset(asker, args, steps.clip_frames(asker, args, model.family))
    healthy = steps.doctor(asker, model, data)
    output = steps.goal_and_output(asker, args, data, model.family)
    start = overrides_from_args(args, family_tiny=model.family.tiny,
                                on_gpu=bool(hardware.gpus))
    request = build_request(hardware, model, data, output, experts)
    base = plan_training(request)
    if not base.fits:
        raise UserError(base.message)
    plan = review(asker, request, base, start, accept=args.accept).plan
    config, dataset_toml = write_all(data, plan, output)
    asker.say(f"\nWrote {config} and {dataset_toml} ({output.fmt} layout).", style="bold")
    for line in commands(plan, output, config):
        asker.say(line, soft_wrap=True)
    if not healthy:
        asker.say("Not offering to train here: the doctor found errors in the dataset (see above); fix them, "
                  "then run `autotune run` as printed by `autotune doctor`'s advice.", style="yellow")
        return 0
    return offer_training(asker, args, hardware, model, data, output, config, dataset_toml,
                          both_experts=plan.settings is not None and plan.settings.high_noise_expert)


def build_request(hardware: steps.Hardware, model: steps.ModelChoice, data: steps.DatasetChoice,
                  output: steps.OutputChoice, experts: str | None = None) -> PlanRequest:
    from autotune.measure.store import load_measurements
    from autotune.planning.planner import PlanRequest, Preferences

    # the same learning store `autotune plan` reads: a wizard plan predicts from this machine's measured runs too
    measured = tuple(load_measurements()) if hardware.device else ()
    return PlanRequest(dataset_dir=str(data.folder), model=model.model, family=model.family, gpus=hardware.gpus,
                       goal=output.goal, priority=output.priority,
                       preferences=Preferences(output_name=output.name, frames=data.frames, experts=experts),
                       cpu_physical_cores=hardware.cpu_cores, cpu_memory_bytes=hardware.ram_bytes,
                       dataset=data.summary, output_dir=str(output.folder), cpu_bf16=hardware.cpu_bf16,
                       probe_summary=hardware.summary + "; autotune wizard", allow_pickle=model.allow_pickle,
                       measurements=measured, measured_device=hardware.device if measured else None)


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Ctrl-C while the files are written takes effect once they are all written."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda number, frame: caught.append(number))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def write_all(data: steps.DatasetChoice, plan: Plan, output: steps.OutputChoice) -> tuple[Path, Path]:
    """The organised dataset (if any), then dataset.toml and config.toml; a failure removes what this made."""
    import shutil

    from autotune.planning.toml_writer import write_plan_files
    from autotune.wizard import organise

    with interrupts_held():
        if data.layout is not None:
            organise.create(data.layout)
        try:
            return write_plan_files(plan, output.folder, output.fmt)
        except BaseException:
            if data.layout is not None:
                shutil.rmtree(data.layout.target, ignore_errors=True)
            raise


def commands(plan: Plan, output: steps.OutputChoice, config: Path) -> list[str]:
    """The exact command lines that train with the written files."""
    if plan.launch_command and plan.launch_command[-1].endswith("musubi_train.sh"):
        return ["Cache and train with musubi-tuner (the script names the model files it needs):",
                "  " + shlex.join(["env", "MUSUBI_TUNER=PATH", *plan.launch_command]),
                "  (PATH: your musubi-tuner checkout, with its venv active)"]
    words = [str(config) if w.endswith("config.toml") else w for w in plan.launch_command]
    lines = ["Train with sd-scripts (run it in your sd-scripts folder):", "  " + shlex.join(words)]
    if output.fmt == "lora-scripts":
        script = next(w for w in words if w.endswith(".py"))
        launch = ["python", "-m", "accelerate.commands.launch", *words[2:]]
        launch[launch.index(script)] = f"./scripts/stable/{script}"
        lines += ["Train with lora-scripts (run it in your lora-scripts folder):", "  " + shlex.join(launch)]
    if plan.model.startswith("builtin:"):
        lines.append(f"  ({plan.model} is lora-autotune's own: sd-scripts needs a real checkpoint there)")
    return lines


def run_command(model: steps.ModelChoice, data: steps.DatasetChoice, output: steps.OutputChoice, config: Path,
                dataset_toml: Path) -> list[str]:
    """``autotune run`` with the written files, into their folder (``autotune.layout``: the LoRA, ``state/`` and
    ``logs/`` beside the configs)."""
    return ["run", str(data.folder), "--model", model.model, "--family", model.family.name, "--config", str(config),
            "--dataset-config", str(dataset_toml), "--out", str(output.folder),
            *(["--allow-pickle"] if model.allow_pickle else [])]


def offer_training(asker: Asker, args: argparse.Namespace, hardware: steps.Hardware, model: steps.ModelChoice,
                   data: steps.DatasetChoice, output: steps.OutputChoice, config: Path, dataset_toml: Path,
                   both_experts: bool = False) -> int:
    """Offer ``autotune run`` on this machine; the configs for another machine end the wizard here."""
    argv = run_command(model, data, output, config, dataset_toml)
    # NVML numbers cards in PCI order; CUDA numbers them fastest first unless told otherwise.
    visible = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": str(hardware.cuda_index)} \
        if hardware.cuda_index is not None else {}
    env = "".join(f"{key}={value} " for key, value in visible.items())
    if not hardware.local:
        asker.say("These configs are for another machine: copy the dataset and the output folder there (the "
                  "paths in them are this machine's) and run the command above.")
        return 0
    from autotune.launch.engines import engine_for

    family = model.family
    engine = engine_for(family)  # the registry's: ours where it trains the family, else the user's trainer
    if family.trains_with.caches_apart:  # autotune run plans it again and supervises its own scripts
        supervised = ["autotune", "run", str(data.folder), "--model", model.model, "--family", family.name,
                      *(["--frames", str(data.frames)] if data.frames > 1 else []),
                      *(["--experts", "both"] if both_experts else []), "--out", str(output.folder),
                      *engine.option.split()]
        asker.say("Or train here under lora-autotune's watchdog (out of memory: more blocks swapped, then smaller; "
                  "killed or stalled: resumed at the exact step):")
        asker.say("  " + env + shlex.join(supervised), soft_wrap=True)
        asker.say(f"  (PATH: {engine.checkout}; add the VAE and text-encoder files as --vae FILE and "
                  f"--{(family.musubi or {}).get('text_encoder_option', 'text_encoder')} FILE"
                  + (", and the high-noise expert as --dit_high_noise FILE" if both_experts else "") + ")")
        return 0
    if not data.kohya_layout:
        asker.say("Not offering to train here: `autotune run` needs N_name subfolders (see above).")
        return 0
    if not family.trained_here:  # sd-scripts trains it; autotune run supervises sd-scripts
        asker.say(f"Train here under lora-autotune's watchdog with your sd-scripts ({family.kohya_script}):")
        asker.say("  " + env + shlex.join(["autotune", *argv, *engine.option.split()]), soft_wrap=True)
        asker.say(f"  (PATH: {engine.checkout})")
        return 0
    asker.say("Train here with lora-autotune (OOM watchdog: steps down and resumes if memory runs out):")
    asker.say("  " + env + shlex.join(["autotune", *argv]), soft_wrap=True)
    if not asker.confirm("Start training now?", default=True, flag="--start", given=args.start,
                         explanation="you can also run the command above later"):
        return 0
    from autotune.launch.run import add_arguments, start_run

    parser = argparse.ArgumentParser(prog="autotune run")
    add_arguments(parser)
    os.environ.update(visible)  # the run's trainer inherits the chosen card
    return start_run(parser.parse_args(argv[1:]))
