"""The plan options (shared by ``autotune plan``, ``run``, ``bench`` and the wizard) and what they become: a
``PlanRequest`` for the probed machine or a named card, and the plan printed as a table."""


from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from autotune.launch.arg_types import finite, lora_name, optimizer_name, resolution_side

if TYPE_CHECKING:
    from autotune.hardware.probe import SystemProbe
    from autotune.planning.planner import Plan
    from autotune.planning.request import PlanRequest
    from sd_scripts_compat.facts.families import FamilySpec


def models_and_cards() -> str:
    """The epilog of `--help`: every built-in model (``--model builtin:ID``) and every catalogue card (``--gpu``)."""
    import textwrap

    from autotune.hardware.gpu_catalog import load_catalog
    from sd_scripts_compat.facts.families import family_names

    def listed(title: str, names: list[str]) -> str:  # a name is never split over two lines
        text = ", ".join(name.replace(" ", "\u00a0") for name in names)
        wrapped = textwrap.fill(text, 100, initial_indent="  ", subsequent_indent="  ")
        return f"{title}\n" + wrapped.replace("\u00a0", " ")

    return "\n\n".join([listed("built-in models (--model builtin:ID; the tiny ones train in seconds on a CPU):",
                                 [f"builtin:{name}" for name in family_names()]),
                          listed("catalogue cards (--gpu NAME; --vram GB for any other):",
                                 [spec.name for spec in load_catalog()])])


# the plan options' groups, as GUI users know them (``--help`` lists them so; the web page's form is made of them)
MODEL, TARGET, DATASET, NETWORK, SCHEDULE, SAVING, ADVANCED = (
    "model and its files", "target machine", "dataset", "network", "optimizer and schedule", "saving and samples",
    "advanced")


def add_arguments(parser: argparse.ArgumentParser, dataset_required: bool = True, bench: bool = False) -> None:
    """The plan's options, in groups; ``bench``: for ``autotune bench``, which writes no configs (no ``--out``),
    whose ``--steps`` are its timed steps (no steps pin) and which saves and samples nothing. `--help` ends with
    the built-in models and catalogue cards."""
    from autotune.launch.user_settings import add_setting_arguments

    parser.epilog = "\n\n".join(filter(None, [parser.epilog, models_and_cards()]))
    groups = {title: parser.add_argument_group(title) for title in (MODEL, TARGET, DATASET, NETWORK, SCHEDULE,
                                                                    SAVING, ADVANCED)}
    _model_arguments(groups[MODEL], dataset_required)
    _target_arguments(groups[TARGET])
    _dataset_arguments(groups[DATASET])
    _network_arguments(groups[NETWORK])
    _schedule_arguments(groups[SCHEDULE], bench)
    _saving_arguments(groups[SAVING], bench)
    if not bench:
        add_setting_arguments(groups)
    _advanced_arguments(groups[ADVANCED])


def _model_arguments(group: argparse._ArgumentGroup, dataset_required: bool) -> None:
    from autotune.planning.profiles import model_file_keys

    group.add_argument("dataset", metavar="DATASET", nargs=None if dataset_required else "?", default=None,
                       help="folder of N_name image subfolders (N = repeats)")
    group.add_argument("--model", required=True, metavar="PATH|builtin:ID",
                       help="base model: a .safetensors file, a diffusers folder, or builtin:sd15 / builtin:sdxl ...")
    group.add_argument("--family", default=None, help="model family when it cannot be detected (e.g. sd2-v)")
    group.add_argument("--allow-pickle", action="store_true",
                       help="allow a .ckpt/.pt model: a pickle can run code when loaded; it is loaded with "
                       "torch.load(weights_only=True), which refuses anything but tensors")
    for key in model_file_keys():  # the separate files sd-scripts' scripts take, by kohya's names
        group.add_argument(f"--{key}", dest=f"file_{key}", default=None, metavar="FILE",
                           help=f"the {key} file, for the families whose script takes one")


def _target_arguments(group: argparse._ArgumentGroup) -> None:
    from autotune.planning.goals import GOALS, PRIORITIES

    group.add_argument("--gpu", action="append", default=None, metavar="NAME",
                       help='plan for this catalogue card instead of probing (repeat for several GPUs)')
    group.add_argument("--vram", action="append", type=finite, default=None, metavar="GB",
                       help="plan for a card with this much memory (with --gpu: that card, smaller)")
    group.add_argument("--gpus", type=int, default=None, metavar="N",
                       help="with one --gpu / --vram: a machine with N such cards (data parallel or sharded)")
    group.add_argument("--emulate-card", type=finite, default=None, metavar="MIB",
                       help="plan (and train) for a card of MIB MiB emulated on this CPU: our engine counts its "
                       "tensors and runs out of memory past it (tests and benches of the memory ladder)")
    group.add_argument("--goal", choices=GOALS, default="character", help="what the LoRA learns (default character)")
    group.add_argument("--priority", choices=PRIORITIES, default="balanced",
                       help="speed | balanced | quality (default balanced)")
    group.add_argument("--ram", type=finite, default=None, metavar="GB",
                       help="plan for a machine with this much RAM in total (default: the probe's available RAM; "
                       "with --gpu/--vram and no --ram, host RAM is predicted but not checked)")
    group.add_argument("--cpu-cores", type=int, default=None,
                       help="physical CPU cores of the training machine (default: this machine's)")


def _dataset_arguments(group: argparse._ArgumentGroup) -> None:
    from autotune.planning.request import EXPERTS

    group.add_argument("--resolution", type=resolution_side, default=None, metavar="PX|W,H",
                       help="pin the training resolution: 768 or 768,768 as kohya writes it")
    group.add_argument("--batch", "--train_batch_size", type=int, default=None,
                       help="pin the micro-batch (a smaller one only if it cannot fit, said with the reason)")
    group.add_argument("--frames", type=int, default=None, metavar="N",
                       help="video families (Wan): frames per clip, 1 + 4k (e.g. 17, 33, 81); default: images")
    group.add_argument("--experts", choices=EXPERTS, default=None,
                       help="Wan 2.2 A14B: train the low-noise expert (--model) alone, or both in one run (the "
                       "high-noise one from --dit_high_noise; default: both when that file is given)")
    group.add_argument("--workers", "--max_data_loader_n_workers", type=int, default=None,
                       help="pin max_data_loader_n_workers (host RAM may still lower it)")


def _network_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--network", choices=("lora", "locon", "loha", "lokr"), default="lora",
                       help="lora (kohya's networks.lora) or a LyCORIS algorithm (lycoris.kohya, the lycoris extra)")
    group.add_argument("--rank", "--network_dim", type=int, default=None, help="pin the LoRA rank (network_dim)")
    group.add_argument("--alpha", "--network_alpha", type=finite, default=None, help="pin network_alpha")
    group.add_argument("--network-arg", action="append", default=[], metavar="KEY=VALUE",
                       help="one more network_args entry, e.g. factor=8 for LoKr, conv_dim=8 (repeat it)")


def _schedule_arguments(group: argparse._ArgumentGroup, bench: bool) -> None:
    from sd_scripts_compat.facts.optimizers import optimizer_names

    group.add_argument("--optimizer", "--optimizer_type", type=optimizer_name, choices=optimizer_names(),
                       default=None, metavar="NAME", help=f"pin the optimizer: {', '.join(optimizer_names())}")
    group.add_argument("--lr", "--learning_rate", type=finite, default=None,
                       help="pin the UNet's / transformer's learning rate (text encoders get half)")
    group.add_argument("--accum", "--gradient_accumulation_steps", type=int, default=None,
                       help="pin gradient accumulation (effective batch = batch x accum)")
    if not bench:
        group.add_argument("--steps", "--max_train_steps", dest="plan_steps", type=int, default=None,
                           help="pin the number of optimizer steps (instead of the goal's epochs)")
    group.add_argument("--epochs", "--max_train_epochs", type=int, default=None, help="pin the number of epochs")


def _saving_arguments(group: argparse._ArgumentGroup, bench: bool) -> None:
    if not bench:
        group.add_argument("--out", default=None, metavar="DIR", help="write config.toml and dataset.toml here")
        group.add_argument("--output-name", "--output_name", type=lora_name, default=None, metavar="NAME",
                           help="the LoRA file's name (default: <dataset>-<family>)")
    group.add_argument("--format", choices=("kohya", "lora-scripts"), default="kohya",
                       help="config layout: kohya (flat) or lora-scripts (sectioned)")


def _advanced_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--no-fp8", action="store_true", help="never store base weights in fp8")
    group.add_argument("--strict", dest="strict_pins", action="store_true",
                       help="refuse (exit 2) a plan in which your --batch / --accum forces another setting down "
                            "(rank, resolution, ...) that the planner's own split would keep")
    group.add_argument("--no-learn", action="store_true",
                       help="plan from the models alone, ignoring this machine's measured runs and benches")
    group.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    group.add_argument("--memory-model-scale", type=finite, default=1.0, metavar="X",
                       help="multiply the memory model's figures by X (tests and benches: a model deliberately "
                       "pessimistic, >1, or optimistic, <1, to see what a run learns)")


def is_pickle(model: str) -> bool:
    from pathlib import Path

    from sd_scripts_compat.models.checkpoint import PICKLE_SUFFIXES

    return Path(model).suffix.lower() in PICKLE_SUFFIXES


def accept_pickle(args: argparse.Namespace, command: str) -> None:
    """A ``.ckpt`` / ``.pt`` model: a one-line refusal naming ``--allow-pickle``, or (with it) its family read
    once here, so no later step loads the pickle again."""
    from sd_scripts_compat.facts.errors import UserError
    from sd_scripts_compat.models.detect import detect_family

    if not is_pickle(args.model):
        return
    if not args.allow_pickle:
        raise UserError(f"{args.model} is a pickle checkpoint, which can run code when loaded; autotune {command} "
                        "loads it only with --allow-pickle (torch.load(weights_only=True)), or convert it to "
                        ".safetensors")
    if args.family is None:
        args.family = detect_family(args.model, allow_pickle=True).name


def _physical_cores() -> int:
    import psutil

    return int(psutil.cpu_count(logical=False) or psutil.cpu_count() or 1)


def build_request(args: argparse.Namespace, family: FamilySpec | None = None) -> PlanRequest:
    """Turn the command line (and, without --gpu/--vram, a live probe) into a PlanRequest; the family is detected
    here, once, unless the caller already did (``family``)."""
    from autotune.launch.user_settings import given_settings
    from autotune.planning.request import PlanRequest, Preferences
    from sd_scripts_compat.models.detect import detect_family

    gpus, cores, ram, probe_line, probe = _targets(args)
    card = emulated_card_mib(args)
    if card is not None:
        gpus, probe_line = [], f"{probe_line}; planned for an emulated card of {card:g} MiB of tensors"
    if args.cpu_cores is not None:
        if args.cpu_cores < 1:
            from sd_scripts_compat.facts.errors import UserError

            raise UserError(f"--cpu-cores {args.cpu_cores}: must be 1 or more")
        cores = args.cpu_cores
    prefs = Preferences(optimizer=args.optimizer, rank=args.rank, resolution=args.resolution, epochs=args.epochs,
                        network=args.network, network_args=tuple(args.network_arg),
                        allow_fp8=not args.no_fp8, workers=args.workers, batch=args.batch, accum=args.accum,
                        learning_rate=args.lr, alpha=args.alpha, steps=getattr(args, "plan_steps", None),
                        frames=getattr(args, "frames", None), experts=getattr(args, "experts", None),
                        output_name=getattr(args, "output_name", None), settings=given_settings(args))
    cpu_bf16 = bool(probe is not None and not gpus and probe.cpu.bf16_native)
    device, records = _measured(args, gpus, probe, card)
    family = family or detect_family(args.model, args.family)
    return PlanRequest(dataset_dir=args.dataset, model=args.model, family=family, gpus=tuple(gpus),
                       goal=args.goal, priority=args.priority, preferences=prefs, cpu_physical_cores=cores,
                       cpu_memory_bytes=ram, output_dir=args.out, probe_summary=probe_line,
                       host_ram_bytes=_host_ram(args, ram), cpu_bf16=cpu_bf16, measurements=records,
                       measured_device=device, allow_pickle=bool(args.allow_pickle and is_pickle(args.model)),
                       model_files=given_model_files(args), strict=bool(getattr(args, "strict_pins", False)),
                       emulated_card_bytes=int(card * 2**20) if card is not None else None,
                       memory_scale=memory_model_scale(args))


def memory_model_scale(args: argparse.Namespace) -> float:
    """``--memory-model-scale X``, checked: a positive factor (1 without it)."""
    from sd_scripts_compat.facts.errors import UserError

    scale = float(getattr(args, "memory_model_scale", 1.0))
    if not scale > 0:
        raise UserError(f"--memory-model-scale {scale:g}: a positive factor, e.g. 1.4 (40% pessimistic)")
    return scale


def emulated_card_mib(args: argparse.Namespace) -> float | None:
    """``--emulate-card MIB``, checked: a positive size, on this machine (no --gpu / --vram); None without it."""
    from sd_scripts_compat.facts.errors import UserError

    memory_model_scale(args)  # said first, as before: both are checked wherever the card is
    card = getattr(args, "emulate_card", None)
    if card is None:
        return None
    if not card > 0:
        raise UserError(f"--emulate-card {card:g}: the card's size in MiB, a positive number (e.g. 14)")
    if args.gpu or args.vram:
        raise UserError("--emulate-card plans for a card emulated on this CPU; drop --gpu / --vram")
    return float(card)


def given_model_files(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """``--clip_l FILE`` ... as (key, absolute path); a file that is not there is one line naming the option."""
    from pathlib import Path

    from autotune.planning.profiles import model_file_keys
    from sd_scripts_compat.facts.errors import UserError

    out = []
    for key in model_file_keys():
        value = getattr(args, f"file_{key}", None)
        if value is None:
            continue
        path = Path(value).expanduser().resolve()
        if not path.is_file():
            raise UserError(f"--{key} {value}: no such file; give the {key} .safetensors file")
        out.append((key, str(path)))
    return tuple(out)


def _host_ram(args: argparse.Namespace, available: int | None) -> int | None:
    """RAM the run may use: --ram GB (a total) less the OS reserve, else the probe's available RAM."""
    from autotune.planning.host_ram import OS_RESERVE_BYTES
    from autotune.planning.request import GIB
    from sd_scripts_compat.facts.errors import UserError

    if args.ram is None:
        return available
    if args.ram <= 0:
        raise UserError(f"--ram {args.ram}: must be a positive number of GB, e.g. --ram 32")
    return max(0, int(args.ram * GIB) - OS_RESERVE_BYTES)


def _measured(args: argparse.Namespace, gpus: list[Any], probe: SystemProbe,
              card: float | None = None) -> tuple[str | None, tuple[Any, ...]]:
    """The device key and this machine's measurements (none with --no-learn, for a --vram-only card, or for a
    named card this machine has not measured; an emulated card's own)."""
    if getattr(args, "no_learn", False) or (probe is None and not args.gpu):
        return None, ()
    from autotune.measure.store import device_key, emulated_device_key, load_measurements

    device = device_key(probe) if probe is not None else gpus[0].spec.name if gpus and gpus[0].spec else None
    if card is not None and probe is not None:
        device = emulated_device_key(probe)
    return device, tuple(load_measurements()) if device else ()


MAX_GPUS = 16  # a machine's cards; more is a typo
MAX_VRAM_GB = 1024  # beyond any card's memory: a larger --vram is bytes or MiB typed where GB are meant


def _targets(args: argparse.Namespace) -> tuple[list[Any], int, int | None, str, Any]:
    """Cards, physical cores, available RAM, the probe's line and the probe (None: a named or --vram card)."""
    from autotune.hardware.gpu_catalog import lookup_gpu
    from autotune.planning.request import gpu_from_spec, gpu_from_vram
    from sd_scripts_compat.facts.errors import UserError

    names, vrams = _times_gpus(args)
    for size in vrams:
        if size > MAX_VRAM_GB:
            raise UserError(f"--vram {size:g}: that is {size:g} GB; --vram takes gigabytes (e.g. --vram 24), not "
                            "bytes or MiB")
    if names or vrams:
        cores = _physical_cores()
        if names and vrams and len(vrams) not in (1, len(names)):
            raise UserError(f"--vram given {len(vrams)} times for {len(names)} --gpu cards; give it once or once "
                            "per card")
        if names:
            specs = [lookup_gpu(name) for name in names]
            sizes: list[float | None] = [*vrams] * len(specs) if len(vrams) == 1 else [*vrams] or [None] * len(specs)
            for given in sizes:
                if given is not None and given <= 0:
                    raise UserError(f"--vram {given}: must be a positive number of GB, e.g. --vram 12")
            gpus = [gpu_from_spec(spec, vram_gb=size, source="catalogue" if size is None else "catalogue+--vram",
                                  name=spec.name if size is None else f"{spec.name} limited to {size:g} GB")
                    for spec, size in zip(specs, sizes, strict=True)]
        else:
            gpus = [gpu_from_vram(size) for size in vrams]
        line = "not probed: planned for " + ", ".join(g.name for g in gpus)
        return gpus, cores, None, line, None
    return _probed_targets(args)


def _times_gpus(args: argparse.Namespace) -> tuple[list[str], list[float]]:
    """The --gpu names and --vram sizes, one card's repeated ``--gpus`` times."""
    from sd_scripts_compat.facts.errors import UserError

    names, vrams, count = list(args.gpu or []), list(args.vram or []), getattr(args, "gpus", None)
    if count is None:
        return names, vrams
    if not 1 <= count <= MAX_GPUS:
        raise UserError(f"--gpus {count}: the number of cards, 1 to {MAX_GPUS}")
    if len(names) > 1 or len(vrams) > 1 or not (names or vrams):
        raise UserError("--gpus N repeats one card: give one --gpu NAME and/or one --vram GB with it (or several "
                        "--gpu for a machine of different cards)")
    return names * count, vrams if names else vrams * count


def _probed_targets(args: argparse.Namespace) -> tuple[list[Any], int, int | None, str, Any]:
    from autotune.hardware.probe import probe_system

    probe = probe_system(output_dir=args.out or ".", use_torch=False)
    return (*targets_from_probe(probe), probe)


def targets_from_probe(probe: SystemProbe) -> tuple[list[Any], int, int | None, str]:
    """A probe's cards as planning targets (what others hold counts as taken), the physical cores, the
    available RAM and a one-line summary; `autotune plan` and `autotune wizard` read a probe this one way."""
    from dataclasses import replace

    from autotune.hardware.gpu_catalog import find_gpu, lookup_gpu
    from autotune.hardware.gpu_links import nvlinked_blocks
    from autotune.planning.request import GENERIC_GPU_NAME, GpuTarget

    cores = int(probe.cpu.physical_cores or probe.cpu.logical_cores or 1)
    gpus, parts = [], []
    cards = [info for info in probe.gpus if info.vram_total_bytes]
    block, nvlink = nvlinked_blocks(cards)  # which of them NVLink joins: the gathers of a sharded run cross it
    for info in cards:
        total = int(info.vram_total_bytes or 0)
        spec = find_gpu(info.catalog_name or info.name, vram_gb=total / 1024**3)
        if spec is None:
            spec = lookup_gpu(GENERIC_GPU_NAME)  # rates only; memory and capability are the probed ones
        spec = replace(spec, nvlink_group=block, nvlink_gbps=nvlink)
        if info.pcie_gbps:  # the link as it runs in this machine (a x16 card in a x4 slot carries a quarter)
            spec = replace(spec, pcie_gbps=info.pcie_gbps)
        # Before training starts, everything in use on the card belongs to others (processes, the display).
        held = max(info.vram_used_bytes or 0, info.other_processes_vram_bytes or 0)
        target = GpuTarget(name=info.name, total_bytes=total, held_bytes=int(held),
                           compute_capability=info.compute_capability or spec.compute_capability,
                           bf16=bool(info.bf16 if info.bf16 is not None else spec.bf16),
                           fp8=bool(info.fp8 if info.fp8 is not None else spec.fp8), spec=spec, source="probe")
        gpus.append(target)
        parts.append(f"{target.name} {target.total_bytes / 1024**3:.1f} GiB total, {held / 1024**3:.2f} GiB held "
                     f"by others{' (display active)' if info.display_active else ''}")
    if gpus:
        line = "; ".join(parts) + f"; {cores} physical CPU cores"
    else:
        line = f"no GPU ({probe.cuda_reason or 'none found'}); {cores} physical CPU cores"
    return gpus, cores, int(probe.memory.ram_available_bytes), line


def render(plan: Plan) -> None:
    """The plan as a rich table (setting, value, reason) plus the predictions."""
    from rich.console import Console
    from rich.table import Table

    from autotune.planning.request import GIB
    from autotune.planning.toml_writer import encode_value, human_seconds

    console = Console()
    console.print(f"[bold]autotune plan[/bold] {plan.model} (family {plan.family.name}) on {plan.device}; "
                  f"goal {plan.goal}, priority {plan.priority}")
    table = Table(show_lines=False)
    table.add_column("setting", style="cyan", no_wrap=True)
    table.add_column("value", style="bold")
    table.add_column("reason")
    for choice in plan.choices:
        value = encode_value(choice.value) if choice.kohya else str(choice.value)
        table.add_row(choice.key, value, choice.reason)
    console.print(table)
    p = plan.prediction
    if p is None:  # a plan that does not fit is its message alone
        return
    unit, unit_name = plan.memory_unit
    console.print(f"predicted peak {plan.memory_noun} [bold]{p.peak_bytes / unit:.2f} {unit_name}[/bold] of "
                  f"{p.usable_bytes / unit:.2f} {unit_name} usable; [bold]{p.it_per_s:.3g} it/s[/bold] "
                  f"({p.micro_steps_per_s:.3g} micro-steps/s per "
                  f"device), {p.samples_per_s:.3g} "
                  f"samples/s; {p.optimizer_steps} steps in [bold]{human_seconds(p.total_seconds)}[/bold]"
                  + (f" (with {human_seconds(p.compile_seconds)} compiling)" if p.compile_seconds else ""))
    console.print(f"speed: [bold]{p.speed_source}[/bold] ({p.speed_basis}); memory: [bold]{p.memory_source}[/bold]"
                  + (f" ({p.memory_basis})" if p.memory_source != "model" else ""))
    for line in plan.learned:
        console.print(f"learned: {line}")
    fill = [c for c in plan.choices if c.placeholder]
    if fill:
        console.print("[yellow]fill in:[/yellow] " + ", ".join(f"{c.key} = {c.value}" for c in fill)
                      + " are placeholders: edit config.toml, or plan with "
                      + " ".join(f"--{c.key} FILE" for c in fill))
    for line in plan.pin_costs:
        console.print(f"[yellow]your pin:[/yellow] {line} (--strict refuses such a plan)")
    console.print("memory by part: " + ", ".join(f"{k} {v / unit:.2f}" for k, v in p.components if v) + f" {unit_name}")
    if p.ram_peak_bytes:
        of = f" of {p.ram_usable_bytes / GIB:.2f} GiB usable" if p.ram_usable_bytes is not None else " (not checked)"
        each = f"{p.loading_processes}, each " if p.ram_processes > 1 else ""
        console.print(f"predicted peak host RAM [bold]{p.ram_peak_bytes / GIB:.2f} GiB[/bold]{of}: {each}"
                      + ", ".join(f"{k} {v / GIB:.2f}" for k, v in p.ram_components if v) + " GiB")
    if plan.dataset is not None:
        console.print(plan.dataset.line(), soft_wrap=True)
    console.print("run: " + " ".join(plan.launch_command))
    for warning in plan.warnings:
        console.print(f"[yellow]warning:[/yellow] {warning}")
