"""The wizard's questions before the plan: hardware, base model, dataset, goal and output.

Each step returns a small frozen record and writes nothing: every file is written at the end, so Ctrl-C at
any question leaves the disk as it was. Checks run as the user types (a bad path is refused under the
prompt and asked again) and are the same checks a flag's value passes.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.layout import CONFIG, DATASET_CONFIG, DEFAULT_ROOT, STATE_DIR, run_name
from autotune.wizard.ask import Asker, Option, integer_check
from sd_scripts_compat.facts.dataset_scan import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS, media_noun
from sd_scripts_compat.facts.errors import UserError

if TYPE_CHECKING:
    from autotune.hardware.probe import SystemProbe
    from autotune.planning.dataset import DatasetSummary
    from autotune.planning.request import GpuTarget
    from sd_scripts_compat.facts.families import FamilySpec

GIB = 1024**3


# ------------------------------------------------------------------------------------------ hardware


@dataclass(frozen=True)
class Hardware:
    """What to plan for. ``local``: this machine (training can start here); ``cuda_index``: the probed GPU
    picked among several (CUDA_VISIBLE_DEVICES for the run)."""

    gpus: tuple[Any, ...]
    cpu_cores: int
    ram_bytes: int | None
    summary: str
    local: bool
    cuda_index: int | None = None
    cpu_bf16: bool = False  # the probed CPU computes bf16 natively: a CPU plan trains in bf16 (as `autotune plan`)
    device: str | None = None  # the measurement store's key for it (``measure.store.device_key``): plans learn


def hardware(asker: Asker, args: argparse.Namespace) -> Hardware:
    """The probe (GPU, VRAM free / total, bf16 / fp8, CPU, RAM), then which device to plan for."""
    from autotune.launch.plan_options import targets_from_probe

    probe, local = _probe(args)
    show_probe(asker, probe, local)
    targets, cores, ram, line = targets_from_probe(probe)
    if args.gpu:
        return _named_card(asker, args, cores, given=args.gpu)
    if args.gpu_index is not None and not 0 <= args.gpu_index < len(targets):
        raise UserError(f"--gpu-index {args.gpu_index}: the probe found {len(targets)} GPU(s)"
                        + (f"; choose 0 to {len(targets) - 1}" if targets else "; drop it"))
    if args.cpu:
        asker.say("Planning for this machine's CPU (--cpu).")
        return Hardware((), cores, ram, line, local, cpu_bf16=bool(probe.cpu.bf16_native), device=_cpu_key(probe))
    if targets:
        index = 0
        if len(targets) > 1:
            best = max(range(len(targets)), key=lambda i: targets[i].usable_bytes)
            options = [Option(f"{i}: {t.name}, {t.usable_bytes / GIB:.1f} GiB free of {t.total_bytes / GIB:.1f}",
                              i) for i, t in enumerate(targets)]
            index = asker.choose("Which GPU should train?", options, default=best, flag="--gpu-index",
                                 given=args.gpu_index,
                                 explanation="the plan fits the card you pick; the others stay free")
        target = _limited(targets[index], args.vram)
        numbers = [gpu.index for gpu in probe.gpus if gpu.vram_total_bytes]  # the order targets_from_probe keeps
        return Hardware((target,), cores, ram, line, local,
                        cuda_index=numbers[index] if len(targets) > 1 else None,
                        device=target.spec.name if target.spec else None)
    asker.say("No GPU found: training here would run on the CPU, which is slow (fine for the builtin:tiny-* "
              "models).", style="yellow")
    where = asker.choose("Plan for", [Option("this machine's CPU", "cpu"),
                                      Option("a named GPU (write configs for another machine)", "named")],
                         default="cpu", flag="--cpu",
                         explanation="a named card's configs are meant to be copied to the machine that has it")
    if where == "cpu":
        return Hardware((), cores, ram, line, local, cpu_bf16=bool(probe.cpu.bf16_native), device=_cpu_key(probe))
    return _named_card(asker, args, cores, given=None)


def _probe(args: argparse.Namespace) -> tuple[Any, bool]:
    from autotune.hardware.probe import SystemProbe, probe_system

    if args.probe:
        try:
            text = Path(args.probe).read_text(encoding="utf-8")
        except OSError as error:
            raise UserError(f"--probe {args.probe}: cannot read it ({error.strerror}); save one with "
                            "`autotune probe --json > probe.json`") from None
        return SystemProbe.from_json(text), False
    return probe_system(output_dir=".", use_torch=False), True


def show_probe(asker: Asker, probe: SystemProbe, local: bool) -> None:
    asker.say("Hardware" + ("" if local else " (from --probe: another machine)"), style="bold")
    for gpu in probe.gpus:
        total, free = gpu.vram_total_bytes, gpu.vram_free_bytes
        vram = (f"{(free or 0) / GIB:.1f} GiB free of {total / GIB:.1f} GiB" if total else "memory unknown")
        flags = ", ".join(f"{name} {'yes' if value else 'no' if value is not None else '?'}"
                          for name, value in (("bf16", gpu.bf16), ("fp8", gpu.fp8)))
        asker.say(f"  GPU {gpu.index}  {gpu.name}: {vram}; {flags}")
    if not probe.gpus:
        asker.say(f"  GPU    none ({probe.cuda_reason or 'not found'})")
    cpu, memory = probe.cpu, probe.memory
    asker.say(f"  CPU    {cpu.model or cpu.arch}: {cpu.physical_cores or '?'} physical cores "
              f"({cpu.logical_cores or '?'} logical)")
    asker.say(f"  RAM    {memory.ram_total_bytes / GIB:.1f} GiB, {memory.ram_available_bytes / GIB:.1f} GiB available")


def gpu_name_problem(text: str) -> str | None:
    from autotune.hardware.gpu_catalog import close_matches_hint, find_gpu, load_catalog

    if not text.strip():
        return "type a card such as RTX 3060 or 4090"
    if find_gpu(text) is None:
        return f"unknown GPU {text!r}: {close_matches_hint(text, load_catalog())}"
    return None


def _named_card(asker: Asker, args: argparse.Namespace, cores: int, given: str | None) -> Hardware:
    from autotune.hardware.gpu_catalog import lookup_gpu
    from autotune.planning.planner import gpu_from_spec

    name = asker.text("GPU to plan for", default="RTX 3060", check=gpu_name_problem, flag="--gpu", given=given,
                      explanation="a catalogue card: its memory, bf16 / fp8 support and speed")
    spec = lookup_gpu(name)
    if args.vram is not None and args.vram <= 0:
        raise UserError(f"--vram {args.vram}: must be a positive number of GB, e.g. --vram 12")
    target = gpu_from_spec(spec, vram_gb=args.vram, source="catalogue" if args.vram is None else "catalogue+--vram",
                           name=spec.name if args.vram is None else f"{spec.name} limited to {args.vram:g} GB")
    asker.say(f"Planning for {target.name}: {target.total_bytes / GIB:.1f} GiB, "
              f"bf16 {'yes' if target.bf16_capable else 'no'}, fp8 {'yes' if target.fp8_base_capable else 'no'}")
    return Hardware((target,), cores, None, f"not probed: planned for {target.name}", local=False, device=spec.name)


def _cpu_key(probe: SystemProbe) -> str:
    from autotune.measure.store import device_key

    return device_key(probe, cpu=True)


def _limited(target: GpuTarget, vram_gb: float | None) -> GpuTarget:
    """``--vram`` on a probed card: plan as if it had only that much (others' share still counts)."""
    if vram_gb is None:
        return target
    if vram_gb <= 0:
        raise UserError(f"--vram {vram_gb}: must be a positive number of GB, e.g. --vram 8")
    return replace(target, total_bytes=min(target.total_bytes, int(vram_gb * GIB)),
                   name=f"{target.name} limited to {vram_gb:g} GB")


# ------------------------------------------------------------------------------------------ model


@dataclass(frozen=True)
class ModelChoice:
    model: str  # builtin:ID or an absolute path, as config.toml names it
    family: FamilySpec  # detected once, here
    allow_pickle: bool = False


def _is_pickle(text: str) -> bool:
    from sd_scripts_compat.models.checkpoint import PICKLE_SUFFIXES

    path = Path(text).expanduser()
    return path.is_file() and path.suffix.lower() in PICKLE_SUFFIXES


def model_problem(text: str) -> str | None:
    """Why ``text`` is not a usable base model, or None. A pickle passes here: it is asked about next."""
    from autotune.planning.planner import detect_family

    text = text.strip()
    if not text:
        return "type a .safetensors / .ckpt file, a diffusers folder or builtin:ID"
    if _is_pickle(text):
        return None
    try:
        detect_family(text)
    except UserError as error:
        return re.sub(r"^--model \S+:? ", "", str(error))
    return None


def base_model(asker: Asker, args: argparse.Namespace) -> ModelChoice:
    """A path (validated, family detected and shown) or a built-in id; a pickle asks before loading."""
    from sd_scripts_compat.facts.families import get_family
    from sd_scripts_compat.models.loading import BUILTIN_IDS

    while True:
        if args.model is None and asker.assume_yes:
            raise UserError("--yes: the base model has no default; pass --model PATH or --model builtin:ID")
        if args.model is None:
            options = [Option("a file or diffusers folder on this disk", "path")]
            demo_first = sorted((name for name in BUILTIN_IDS if not get_family(name).builtin_meta_only),
                                key=lambda name: (not get_family(name).tiny, get_family(name).is_transformer, name))
            # meta-only ids cannot train; the SD demos (the quickstart's tiny-sd15) before the FLUX ones
            options += [Option(f"builtin:{name}  {get_family(name).description}", f"builtin:{name}")
                        for name in demo_first]
            kind = asker.choose("Base model", options, default="path",
                                explanation="the model the LoRA is trained on; builtin ids have random weights")
            if kind != "path":
                return ModelChoice(model=kind, family=_family(asker, args, kind))
        text = asker.text("Model file or folder", default="", check=model_problem, flag="--model", given=args.model,
                          path=True, explanation=".safetensors or .ckpt checkpoint, or a diffusers folder")
        if text.startswith("builtin:"):
            return ModelChoice(model=text, family=_family(asker, args, text))
        model = str(Path(text).expanduser().resolve())
        if not _is_pickle(model):
            return ModelChoice(model=model, family=_family(asker, args, model))
        allowed = asker.confirm(f"{Path(model).name} is a pickle checkpoint: loading one can run code hidden in it. "
                                "Load it anyway (torch.load with weights_only=True, which refuses code)?",
                                default=False, flag="--allow-pickle", given=True if args.allow_pickle else None,
                                explanation="a .safetensors file holds only tensors and needs no such trust")
        if allowed:
            return ModelChoice(model=model, family=_family(asker, args, model, pickle=True), allow_pickle=True)
        if args.model is not None or asker.assume_yes:
            raise UserError(f"--model {args.model}: a pickle checkpoint; pass --allow-pickle to load it with "
                            "weights_only=True, or convert it to .safetensors")
        asker.say("Choose another model.")


def _family(asker: Asker, args: argparse.Namespace, model: str, pickle: bool = False) -> FamilySpec:
    """Detected (headers and configs only; a pickle is loaded with weights_only), SD 2.x's prediction asked."""
    from autotune.planning.planner import detect_family
    from sd_scripts_compat.facts.families import get_family

    if pickle and args.family is None:
        asker.say(f"Reading {Path(model).name}'s keys to tell its family ...")
        name = family_of_pickle(Path(model))
    else:
        name = detect_family(model, args.family).name
    siblings = _prediction_siblings(name)
    if len(siblings) > 1 and not model.startswith("builtin:"):
        name = asker.choose("Which prediction does this model use?",
                            [Option(f"{f.prediction_type} ({f.description})", f.name) for f in siblings],
                            default=name, flag="--family", given=args.family,
                            explanation="SD 2 files often do not say; 768 px models are usually v-prediction")
    family = get_family(name)
    asker.say(f"Model family [bold]{name}[/bold]: {family.description}", markup=True)
    return family


def _prediction_siblings(name: str) -> list[Any]:
    """Families a file cannot tell apart from ``name``: the same architecture, another prediction type."""
    from sd_scripts_compat.facts.families import get_family
    from sd_scripts_compat.models.detect import UNET_DISTINGUISHING_KEYS, all_families

    family = get_family(name)
    return [f for f in all_families() if f.single_file_layout == family.single_file_layout and f.tiny == family.tiny
            and all(f.unet.get(key) == family.unet.get(key) for key in UNET_DISTINGUISHING_KEYS)]


def family_of_pickle(path: Path) -> str:
    """A pickle checkpoint's family (loaded with weights_only=True, after the user allowed it), by the
    shared detector's rules."""
    from sd_scripts_compat.models.detect import detect_family

    return detect_family(path, allow_pickle=True).name


# ------------------------------------------------------------------------------------------ dataset


@dataclass(frozen=True)
class DatasetChoice:
    folder: Path  # what training reads: the user's folder, or the N_name folder made at the end
    summary: Any  # the planner's DatasetSummary
    layout: Any = None  # organise.FlatLayout to create at the end, or None
    kohya_layout: bool = True  # N_name subfolders: kohya's train_data_dir and `autotune run` can read it
    frames: int = 1  # a video family's clip length (its folders hold videos); 1: images


def dataset_problem(text: str, media: tuple[str, ...] = IMAGE_EXTENSIONS) -> str | None:
    from autotune.planning.planner import scan_dataset

    if not text.strip():
        return f"type the folder that holds your {media_noun(media)}"
    path = Path(text).expanduser()
    if not path.is_dir():
        return f"{path} is not a folder"
    try:
        scan_dataset(path, media)
    except UserError as error:
        return str(error)
    return None


def clip_frames(asker: Asker, args: argparse.Namespace, spec: FamilySpec) -> int:
    """A video family's clip length (1 + 4k frames; 1 trains it on a folder of images); no question otherwise."""
    from autotune.planning.request import validate_frames

    if not (spec.musubi or {}).get("video"):
        validate_frames(args.frames, spec)  # --frames on an image family: one line
        return 1

    def problem(text: str) -> str | None:
        try:
            validate_frames(int(text), spec)
        except ValueError:
            return "a whole number of frames (e.g. 33), or 1 for images"
        except UserError as error:
            return str(error).split(": ", 1)[-1]
        return None

    given = None if args.frames is None else str(args.frames)
    return int(asker.text("Frames per clip", default="1", check=problem, flag="--frames", given=given,
                          explanation=f"{spec.name} trains on videos: each sample is the first N frames of a clip "
                          "(1 + 4k, e.g. 33 or 81); 1 trains it on a folder of images"))


def experts(asker: Asker, args: argparse.Namespace, family: FamilySpec) -> str | None:
    """Wan 2.2 A14B: the low-noise expert alone or both in one run (musubi's ``--dit_high_noise``); no question for
    a family with one DiT (``--experts both`` there is refused by the plan, in one line)."""
    from autotune.planning.profiles import plan_profile

    if plan_profile(family).both_experts is None:
        return args.experts
    return asker.choose("Experts", [Option("the low-noise expert alone (the --model file)", "low"),
                                    Option("both experts in one run (one LoRA; the high-noise file as "
                                           "--dit_high_noise; more memory)", "both")],
                        default="low", flag="--experts", given=args.experts,
                        explanation=f"{family.name} is two 14B experts: the high-noise one denoises timesteps from "
                        "875, the low-noise one those below; musubi-tuner trains one or both")


def dataset(asker: Asker, args: argparse.Namespace, frames: int = 1) -> DatasetChoice:
    """A folder, checked on the spot through the shared scan; a flat one may become ``N_name``. Clips
    (``frames`` > 1): a folder of videos, taken as it is."""
    from autotune.planning.planner import scan_dataset

    media = VIDEO_EXTENSIONS if frames > 1 else IMAGE_EXTENSIONS
    noun = media_noun(media)
    if args.dataset is None and asker.assume_yes:
        raise UserError(f"--yes: the dataset has no default; pass the folder of {noun} as DATASET")
    text = asker.text("Dataset folder", default="", check=lambda t: dataset_problem(t, media), flag="DATASET",
                      given=args.dataset, path=True, only_directories=True,
                      explanation=f"N_name subfolders (N = repeats per epoch), or a flat folder of {noun}")
    folder = Path(text).expanduser().resolve()
    summary = scan_dataset(folder, media)
    show_dataset(asker, summary)
    flat = len(summary.subsets) == 1 and Path(summary.subsets[0].image_dir).resolve() == folder
    if not flat or frames > 1:  # musubi reads any folder of videos (video_directory): nothing to organise
        return DatasetChoice(folder=folder, summary=summary, frames=frames)
    return _offer_organise(asker, args, folder, summary)


def doctor(asker: Asker, model: ModelChoice, data: DatasetChoice) -> bool:
    """`autotune doctor`'s checks on the chosen folder, for the chosen model: the brief now; False on errors
    (the wizard then writes the configs but starts no training, as `autotune run` would refuse to)."""
    from autotune.doctor import check_before_training

    try:
        lines = check_before_training(data.folder, family=model.family,
                                      frames=data.frames if data.frames > 1 else None)
    except UserError as error:
        asker.say(f"  doctor: {error}", style="red")
        return False
    for line in lines:
        asker.say(f"  {line}")
    return True


def show_dataset(asker: Asker, summary: DatasetSummary) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=None, show_edge=False, pad_edge=False)
    for column in ("folder", "repeats", summary.noun, "captions", "class tokens"):
        table.add_column(column, justify="right" if column in ("repeats", summary.noun, "captions") else "left")
    for subset in summary.subsets:
        table.add_row(escape(Path(subset.image_dir).name), str(subset.num_repeats), str(subset.num_images),
                      str(subset.num_captions), escape(subset.class_tokens or ""))
    asker.console.print(table)
    views = "image-views" if summary.noun == "images" else "clip-views"
    asker.say(f"  {summary.num_images} {summary.noun}, {summary.views_per_epoch} {views} per epoch, captions "
              f"{summary.caption_extension}")
    for warning in summary.warnings:
        asker.say(f"  problem: {warning}", style="yellow")


def _offer_organise(asker: Asker, args: argparse.Namespace, folder: Path, summary: DatasetSummary) -> DatasetChoice:
    from autotune.wizard import organise

    asker.say(f"The images sit directly in {folder}; kohya's train_data_dir and `autotune run` read "
              "<repeats>_<trigger> subfolders.")
    given = None if args.organise is None else args.organise != "no"
    if not asker.confirm("Make that folder structure from these images?", default=True, flag="--organise",
                         given=given, explanation="your files are linked or copied into a new folder, never moved"):
        asker.say("Kept as it is: dataset.toml reads the folder directly (1 repeat, no class tokens); "
                  "`autotune run` needs N_name subfolders, so the wizard will not start training.", style="yellow")
        return DatasetChoice(folder=folder, summary=summary, kohya_layout=False)
    repeats = int(asker.text("Repeats per epoch", default="10", check=integer_check(1, 1000), flag="--repeats",
                             given=None if args.repeats is None else str(args.repeats),
                             explanation="how often each image is seen per epoch (the N of N_name)"))
    trigger = asker.text("Trigger word", default=organise.safe_name(folder.name), flag="--trigger",
                         given=args.trigger, check=organise.trigger_problem,
                         explanation="the class tokens in the folder name; the caption of images without one")
    mode = asker.choose("Link or copy the images?",
                        [Option("link (symbolic links: no extra disk space)", "link"), Option("copy", "copy")],
                        default="link", flag="--organise", given=args.organise if args.organise != "no" else None,
                        explanation="either way the originals stay where they are")
    target = asker.text("New dataset folder", default=str(organise.default_target(folder)),
                        check=organise.target_problem, flag="--organise-into", given=args.organise_into, path=True,
                        explanation="created when the files are written, at the end")
    layout = organise.plan_layout(folder, Path(target), repeats, trigger, mode)
    asker.say(f"Will {mode} {len(layout.files)} files into {layout.subset_dir}")
    return DatasetChoice(folder=layout.target, summary=layout.summary(summary), layout=layout)


# ------------------------------------------------------------------------------------------ goal


@dataclass(frozen=True)
class OutputChoice:
    goal: str
    priority: str
    name: str
    folder: Path
    fmt: str


GOAL_HELP = {"character": "a person or creature's identity", "style": "a look that spreads over many images",
             "concept": "one object, pose or idea"}
PRIORITY_HELP = {"speed": "fewer steps (0.75x), 8-bit optimizer", "balanced": "the planner's middle",
                 "quality": "more steps (1.25x), fp32 optimizer state"}


def name_problem(text: str) -> str | None:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", text.strip()):
        return "letters, digits, '.', '-' and '_' only (it names the LoRA file)"
    return None


def output_problem(text: str) -> str | None:
    """The output folder must not hold an earlier config or run: the wizard never overwrites."""
    if not text.strip():
        return "type a folder"
    folder = Path(text).expanduser()
    if folder.exists() and not folder.is_dir():
        return f"{folder} is a file"
    taken = [name for name in (CONFIG, DATASET_CONFIG, STATE_DIR) if (folder / name).exists()]
    if taken:
        return f"{folder} holds {', '.join(taken)} already; choose a new folder (nothing is overwritten)"
    return None


def goal_and_output(asker: Asker, args: argparse.Namespace, data: DatasetChoice, family: FamilySpec) -> OutputChoice:
    from autotune.planning.planner import GOAL_PROFILES, GOALS, PRIORITIES

    goal = asker.choose("Goal", [Option(f"{g}: {GOAL_HELP[g]} (rank {GOAL_PROFILES[g].rank})", g) for g in GOALS],
                        default="character", flag="--goal", given=args.goal,
                        explanation="sets the LoRA rank, the batch and how long it trains")
    priority = asker.choose("Priority", [Option(f"{p}: {PRIORITY_HELP[p]}", p) for p in PRIORITIES],
                            default="balanced", flag="--priority", given=args.priority,
                            explanation="trades training time against quality")
    name = asker.text("Output name", default=run_name(data.folder, family), check=name_problem, flag="--output-name",
                      given=args.output_name, explanation="the LoRA file's name (kohya's output_name)")
    default_folder = DEFAULT_ROOT / name
    number = 2
    while output_problem(str(default_folder)):
        default_folder, number = DEFAULT_ROOT / f"{name}-{number}", number + 1
    folder = asker.text("Output folder", default=str(default_folder), check=output_problem, flag="--out",
                        given=args.out, path=True, only_directories=True,
                        explanation="config.toml, dataset.toml, the LoRA, state/ and logs/ go here")
    fmt = asker.choose("Config layout", [Option("kohya (flat, sd-scripts / kohya_ss)", "kohya"),
                                         Option("lora-scripts (sectioned, as its GUI saves)", "lora-scripts")],
                       default="kohya", flag="--format", given=args.format,
                       explanation="both hold the same keys; sd-scripts reads either")
    return OutputChoice(goal=goal, priority=priority, name=name.strip(), folder=Path(folder).expanduser().resolve(),
                        fmt=fmt)
