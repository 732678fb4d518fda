"""What a plan is asked for: the devices to plan for, the user's pinned preferences, and their checks.

``gpu_from_spec`` / ``gpu_from_vram`` turn a catalogue card or a bare ``--vram GB`` into a
``GpuTarget``; ``validate_request`` turns a bad goal, priority or preference into a one-line UserError
naming the option, before anything is planned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autotune.planning.dataset import DatasetSummary
from autotune.planning.goals import GOALS, PRIORITIES
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.optimizers import optimizer_names

if TYPE_CHECKING:
    from autotune.hardware.gpu_catalog import GpuSpec
    from sd_scripts_compat.facts.families import FamilySpec

GIB = 1024**3
# Cards without a name (--vram only) plan with these rates: a mid Ampere card, bf16 capable.
GENERIC_GPU_NAME = "RTX 3090"
EMULATED_CARD = "emulated card"  # a plan's device label for --emulate-card (sd_scripts_compat.training.emulated_card)


def emulated_card_label(size_mib: float) -> str:
    return f"{EMULATED_CARD} of {size_mib:g} MiB of tensors (on this CPU)"
ATTENTIONS = ("sdpa", "xformers")


@dataclass(frozen=True)
class GpuTarget:
    """One device to plan for: its memory, what others already hold on it, and its catalogue rates."""

    name: str
    total_bytes: int
    held_bytes: int = 0  # other processes + display, from the live probe; 0 for a named card
    compute_capability: str | None = None
    bf16: bool = False
    fp8: bool = False
    spec: GpuSpec | None = None
    source: str = "catalogue"  # "probe", "catalogue", "--vram"

    @property
    def usable_bytes(self) -> int:
        return max(0, self.total_bytes - self.held_bytes)

    @property
    def cc_tuple(self) -> tuple[int, int] | None:
        if not self.compute_capability:
            return None
        major, minor = self.compute_capability.split(".")
        return int(major), int(minor)

    @property
    def bf16_capable(self) -> bool:
        cc = self.cc_tuple
        return cc >= (8, 0) if cc is not None else self.bf16

    @property
    def fp8_base_capable(self) -> bool:
        """fp8_base stores frozen weights in float8: the planner proposes it from compute capability 8.9 (where it pays
        off), or from the family profile's lower floor (FLUX.1: 8.0, where the engine takes it too)."""
        cc = self.cc_tuple
        return cc is not None and cc >= (8, 9)


@dataclass(frozen=True)
class Preferences:
    """What the user pinned. None = let the planner choose."""

    optimizer: str | None = None  # AdamW8bit | AdamW | Prodigy
    train_text_encoder: bool | None = None
    rank: int | None = None
    resolution: int | None = None
    attention: str = "sdpa"  # sdpa | xformers
    allow_fp8: bool = True
    epochs: int | None = None
    seed: int = 42
    output_name: str | None = None
    workers: int | None = None  # max_data_loader_n_workers (host RAM may step it down)
    network: str = "lora"  # lora (the family's kohya module) or a LyCORIS algorithm (NETWORKS)
    network_args: tuple[str, ...] = ()  # more "key=value" network_args (LoKr's factor=8, conv_dim=4, ...)
    batch: int | None = None  # train_batch_size (micro-batch)
    accum: int | None = None  # gradient_accumulation_steps
    learning_rate: float | None = None  # the UNet's rate (the text encoders' is half of it, as planned)
    alpha: float | None = None  # network_alpha
    steps: int | None = None  # max_train_steps (instead of the goal's epochs)
    frames: int | None = None  # video frames per sample (a video family's target_frames, N*4+1); None: images
    experts: str | None = None  # Wan 2.2 A14B: "low" (the --dit expert alone) or "both" (with --dit_high_noise)
    settings: tuple[tuple[str, Any], ...] = ()  # sd-scripts settings the user gave (launch.user_settings), kept


@dataclass(frozen=True)
class PlanRequest:
    dataset_dir: str | None
    model: str  # "builtin:sdxl" or a path (safetensors file / diffusers folder)
    family: FamilySpec | None = None  # the family the edge turned the model (and --family) into; None: detected
    gpus: tuple[GpuTarget, ...] = ()  # empty: plan for this machine's CPU
    goal: str = "character"
    priority: str = "balanced"
    preferences: Preferences = field(default_factory=Preferences)
    cpu_physical_cores: int = 4
    cpu_memory_bytes: int | None = None  # for CPU-only plans
    dataset: DatasetSummary | None = None  # given instead of scanning ``dataset_dir`` (templates)
    output_dir: str | None = None  # where config.toml goes; trained LoRAs go to <output_dir>/output
    probe_summary: str = ""  # one line describing the probe, for the config header
    cpu_bf16: bool = False  # the CPU computes bf16 natively (avx512_bf16 / AMX): CPU plans train in bf16
    measurements: tuple[Any, ...] = ()  # autotune.measure.store.Measurement records of this machine
    measured_device: str | None = None  # the device key the measurements are looked up by (None: not used)
    host_ram_bytes: int | None = None  # RAM the run may use (probe: available; --ram: total - reserve); None: unchecked
    allow_pickle: bool = False  # the model is a .ckpt / .pt the user allowed (the config says allow_pickle)
    model_files: tuple[tuple[str, str], ...] = ()  # (kohya key, path) the user gave: --clip_l FILE, --t5xxl FILE ...
    strict: bool = False  # --strict: refuse a plan in which the pinned micro-batch split forces another setting down
    emulated_card_bytes: int | None = None  # --emulate-card: a card of this many tensor bytes, emulated on the CPU
    memory_scale: float = 1.0  # --memory-model-scale: the memory model's figures times this (tests and benches)


def gpu_from_spec(spec: GpuSpec, vram_gb: float | None = None, held_bytes: int = 0,
                  source: str = "catalogue", name: str | None = None) -> GpuTarget:
    """A planning target from a catalogue card; ``vram_gb`` overrides its memory (emulating a smaller card)."""
    gb = spec.vram_gb if vram_gb is None else vram_gb
    return GpuTarget(name=name or spec.name, total_bytes=int(round(gb * GIB)), held_bytes=held_bytes,
                     compute_capability=spec.compute_capability, bf16=spec.bf16, fp8=spec.fp8, spec=spec,
                     source=source)


def gpu_from_vram(vram_gb: float, base: GpuSpec | None = None) -> GpuTarget:
    """``--vram GB`` alone: a card of that size with the rates of ``base`` (default: a generic Ampere card)."""
    if vram_gb <= 0:
        raise UserError(f"--vram {vram_gb}: must be a positive number of GB, e.g. --vram 12")
    if base is None:
        from autotune.hardware.gpu_catalog import lookup_gpu

        base = lookup_gpu(GENERIC_GPU_NAME)
    return gpu_from_spec(base, vram_gb=vram_gb, source="--vram", name=f"{vram_gb:g} GB GPU ({base.name} rates)")


def validate_request(request: PlanRequest) -> None:
    """A one-line UserError naming the option for a bad goal, priority or preference."""
    if request.goal not in GOALS:
        raise UserError(f"--goal {request.goal}: unknown goal; choose one of {', '.join(GOALS)}")
    if request.priority not in PRIORITIES:
        raise UserError(f"--priority {request.priority}: unknown priority; choose one of {', '.join(PRIORITIES)}")
    prefs = request.preferences
    trained = optimizer_names()
    if prefs.optimizer is not None and prefs.optimizer not in trained:
        raise UserError(f"--optimizer {prefs.optimizer}: the engine trains {', '.join(trained)}")
    for flag, value in (("--batch", prefs.batch), ("--accum", prefs.accum), ("--steps", prefs.steps)):
        if value is not None and value < 1:
            raise UserError(f"{flag} {value}: must be 1 or more")
    for flag, rate in (("--lr", prefs.learning_rate), ("--alpha", prefs.alpha)):
        if rate is not None and not rate > 0:
            raise UserError(f"{flag} {rate:g}: must be a positive number")
    if prefs.steps is not None and prefs.epochs is not None:
        raise UserError(f"--steps {prefs.steps} and --epochs {prefs.epochs}: give one of them (kohya's "
                        "max_train_epochs would override max_train_steps)")
    if prefs.rank is not None and prefs.rank < 1:
        raise UserError(f"--rank {prefs.rank}: must be a positive integer, e.g. 16")
    if prefs.workers is not None and prefs.workers < 0:
        raise UserError(f"--workers {prefs.workers}: must be 0 or more")
    if prefs.epochs is not None and prefs.epochs < 1:
        raise UserError(f"--epochs {prefs.epochs}: must be 1 or more")
    if prefs.attention not in ATTENTIONS:
        raise UserError(f"--attention {prefs.attention}: choose sdpa or xformers")
    if prefs.network not in NETWORKS:
        raise UserError(f"--network {prefs.network}: choose one of {', '.join(NETWORKS)}")
    for entry in prefs.network_args:
        if "=" not in entry:
            raise UserError(f"--network-arg {entry}: write key=value, e.g. factor=8")
        key, _, given = entry.partition("=")
        if key.strip() == "algo" and given.strip() != prefs.network:
            raise UserError(f"--network-arg {entry}: --network {prefs.network} already names the algorithm; give "
                            f"--network {given.strip()} instead")


def network_choice(prefs: Preferences, family: FamilySpec) -> tuple[str, tuple[str, ...]]:
    """(network_module, network_args) the preferences ask for, checked by the engine's own network_args reader
    (LyCORIS: lycoris-lora installed, a known algorithm; not for FLUX)."""
    from sd_scripts_compat.config.network_args import LYCORIS_MODULE, parse_network_args

    entries = dict(entry.split("=", 1) for entry in prefs.network_args)
    if prefs.network == "lora":
        module = family.network_module
    else:
        if family.unet_lora_names == "bfl":
            raise UserError(f"--network {prefs.network}: LyCORIS cannot train {family.name} here (lycoris-lora would "
                            "write keys sd-scripts and ComfyUI do not load for FLUX); use --network lora")
        module, entries = LYCORIS_MODULE, {"algo": prefs.network, **entries}
    parse_network_args(entries, module, sdxl=family.is_sdxl, where="--network-arg")
    return module, tuple(f"{key}={value}" for key, value in entries.items())


NETWORKS = ("lora", "locon", "loha", "lokr")  # lora: networks.lora(_flux); the others: lycoris.kohya algorithms


def validate_resolution(resolution: int | None, family: FamilySpec) -> None:
    """A pinned ``--resolution`` must be one the engine trains this family at (``FamilySpec.resolution_problem``,
    the rule the engine applies to a config)."""
    if resolution is None:
        return
    problem = family.resolution_problem(resolution, resolution)
    if problem is not None:
        raise UserError(f"--resolution {resolution}: {problem}; e.g. --resolution {family.resolution}")


def validate_frames(frames: int | None, family: FamilySpec) -> None:
    """``--frames`` only for a video family, as its VAE takes them: 1 + 4k (musubi's target_frames for Wan)."""
    if frames is None or frames == 1:
        return
    if not (family.musubi or {}).get("video"):
        raise UserError(f"--frames {frames}: {family.name} trains on images; drop --frames")
    stride = family.temporal_stride
    if frames < 1 or (frames - 1) % stride:
        raise UserError(f"--frames {frames}: {family.name} takes 1 + {stride}k frames (e.g. 17, 33, 81)")


EXPERTS = ("low", "both")


def wants_both_experts(request: PlanRequest, file_key: str | None) -> bool:
    """Whether the plan trains two experts (Wan 2.2): ``--experts both``, or the second expert's file
    (``file_key``: the profile's, None for a family with one) given without ``--experts``. Checked first: a
    one-line UserError for ``--experts both`` on a family with one expert or ``low`` beside the second file."""
    experts = request.preferences.experts
    given = file_key is not None and any(key == file_key for key, _ in request.model_files)
    if experts is not None and experts not in EXPERTS:
        raise UserError(f"--experts {experts}: choose one of {', '.join(EXPERTS)}")
    if experts == "both" and file_key is None:
        raise UserError(f"--experts both: {request.model} has one DiT; only Wan 2.2 A14B trains two experts")
    if experts == "low" and given:
        raise UserError(f"--experts low with --{file_key}: the second expert's file trains only with --experts "
                        "both; drop one of them")
    return experts == "both" or (experts is None and given)
