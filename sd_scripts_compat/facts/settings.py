"""The settings that decide a run's memory, speed and stability: one type, with kohya's names, everywhere.

The planner chooses a ``TrainSettings``, the writer turns it into config.toml / dataset.toml, the
engine reports the one it actually resolved (after kohya's precedence: subset > dataset > general >
config > defaults), and the OOM ladder (memory) and the stability ladder (learning rate, warm-up,
clipping, precision) step down from that report. Every side uses this type, and the moves between settings,
the mapping to kohya's files and the reader back live once, in ``config.settings_space``; a value cannot be lost
between them: the micro-batch a dataset.toml sets is the micro-batch the ladder sees.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from sd_scripts_compat.facts.kohya_toml import parse_resolution

# fields added after events were first stored: a block written before them reads as their defaults
_LATER_FIELDS: dict[str, Any] = {"network_module": "networks.lora", "network_args": (),
                                  "cpu_offload_checkpointing": False, "torch_compile": False,
                                  "dynamo_backend": "inductor", "frames": 1,
                                  "use_pinned_memory_for_block_swap": False, "high_noise_expert": False,
                                  "offload_inactive_dit": False, "fsdp": None, "fsdp_offload_params": False,
                                  "fsdp_shard_size": 0, "shard_optimizer_state": False}


def hybrid_group_sizes(processes: int) -> list[int]:
    """The group sizes ``hybrid_shard`` may shard within on ``processes`` processes: the divisors from 2 to half of
    them, so that there are several groups (4: 2; 8: 2 or 4; 2 or 3: none)."""
    return [size for size in range(2, processes // 2 + 1) if processes % size == 0]


@dataclass(frozen=True)
class TrainSettings:
    """Memory-, speed- and stability-relevant knobs of one run, by their kohya names.

    ``train_batch_size`` is the micro-batch the dataset really uses (a dataset.toml's ``batch_size``
    wins over the config's), ``resolution`` is (width, height), ``max_bucket_reso`` is None when
    bucketing is off. The learning-rate fields default to kohya's defaults (TrainingConfig's); the
    planner writes its own rates through its choices, so it never reads them from here.
    """

    train_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    resolution: tuple[int, int] = (512, 512)
    gradient_checkpointing: bool = False
    optimizer_type: str = "AdamW"
    network_dim: int = 16
    network_alpha: float | None = None
    network_train_unet_only: bool = False
    mixed_precision: str = "no"
    fp8_base: bool = False
    cache_latents: bool = False
    cache_text_encoder_outputs: bool = False
    max_bucket_reso: int | None = None
    xformers: bool = False
    learning_rate: float = 2e-6
    unet_lr: float | None = None
    text_encoder_lr: tuple[float, ...] | None = None
    lr_scheduler: str = "constant"
    lr_warmup_steps: int | float = 0  # int: steps; float in (0, 1): a ratio of the total steps (kohya)
    max_grad_norm: float = 1.0  # 0: no clipping
    full_fp16: bool = False
    full_bf16: bool = False
    blocks_to_swap: int = 0  # FLUX: transformer blocks kept in host memory and copied in around their use
    cpu_offload_checkpointing: bool = False  # a transformer's checkpointed block inputs wait in host memory
    network_module: str = "networks.lora"  # "lycoris.kohya": LyCORIS, its algorithm in network_args
    network_args: tuple[str, ...] = ()  # kohya's "key=value" entries, as written
    torch_compile: bool = False  # each repeated block of the denoiser compiled (training.compiled_blocks)
    dynamo_backend: str = "inductor"  # the compiler torch_compile uses (kohya's option)
    frames: int = 1  # video frames of one sample (musubi-tuner's target_frames for Wan); 1: images
    use_pinned_memory_for_block_swap: bool = False  # musubi-tuner: the swapped blocks live in page-locked RAM
    high_noise_expert: bool = False  # Wan 2.2: the high-noise expert trains too (musubi's --dit_high_noise)
    offload_inactive_dit: bool = False  # ... and the expert not in use waits in host RAM (no block swap then)
    fsdp: str | None = None  # several processes: the frozen denoiser sharded across them (training.sharding)
    fsdp_offload_params: bool = False  # ... each one's share in host RAM, copied to the card for each gather
    fsdp_shard_size: int = 0  # hybrid_shard: the processes of each group that shards it (the groups replicate it)
    shard_optimizer_state: bool = False  # several processes: each keeps the optimizer state of its share of the LoRA

    @property
    def effective_batch(self) -> int:
        """Samples per optimizer step on one device."""
        return self.train_batch_size * self.gradient_accumulation_steps

    @property
    def weight_dtype(self) -> str:
        """The frozen base weights' storage: fp8, bf16, fp16 or fp32."""
        if self.fp8_base:
            return "fp8"
        return {"bf16": "bf16", "fp16": "fp16"}.get(self.mixed_precision, "fp32")

    def shard_ranks(self, processes: int) -> int:
        """The processes across which one copy of the frozen denoiser is sharded, in a run of ``processes``: 1
        unsharded, ``fsdp_shard_size`` with ``hybrid_shard`` (each group of that many holds a whole copy), else
        all of them."""
        if not self.fsdp:
            return 1
        return self.fsdp_shard_size if self.fsdp == "hybrid_shard" else processes

    def state_ranks(self, processes: int) -> int:
        """The processes the LoRA's optimizer state is split across in a run of ``processes``
        (``shard_optimizer_state``), else 1."""
        return processes if self.shard_optimizer_state else 1

    @property
    def attention(self) -> str:
        return "xformers" if self.xformers else "sdpa"

    def with_rank(self, network_dim: int, network_alpha: float | None = None) -> TrainSettings:
        """Another rank; alpha follows in proportion unless given, so the LoRA's scale alpha/dim holds."""
        if network_alpha is None and self.network_alpha is not None:
            network_alpha = self.network_alpha * network_dim / self.network_dim
        return replace(self, network_dim=network_dim, network_alpha=network_alpha)

    def changed_from(self, base: TrainSettings) -> dict[str, tuple[Any, Any]]:
        """Field -> (old, new) for every field that differs from ``base``."""
        old, new = asdict(base), asdict(self)
        return {k: (old[k], new[k]) for k in old if old[k] != new[k]}

    # ---- events -----------------------------------------------------------------------------------

    def to_event(self) -> dict[str, Any]:
        """JSON-ready, every field present (the ``settings`` block of the engine's events)."""
        out = asdict(self)
        out["resolution"] = list(self.resolution)
        out["text_encoder_lr"] = list(self.text_encoder_lr) if self.text_encoder_lr is not None else None
        out["network_args"] = list(self.network_args)
        return out

    @classmethod
    def from_event(cls, values: Mapping[str, Any]) -> TrainSettings:
        """Read a ``to_event`` block back; a missing or ill-typed field is a ValueError naming it."""
        names = {f.name for f in fields(cls)}
        missing = sorted(names - set(values) - set(_LATER_FIELDS))
        if missing:
            raise ValueError(f"settings block lacks {', '.join(missing)}")
        data = {name: values.get(name, _LATER_FIELDS.get(name)) for name in names}
        data["resolution"] = parse_resolution(data["resolution"])
        for name in ("train_batch_size", "gradient_accumulation_steps", "network_dim", "blocks_to_swap",
                     "fsdp_shard_size"):
            data[name] = int(data[name])
        if data["max_bucket_reso"] is not None:
            data["max_bucket_reso"] = int(data["max_bucket_reso"])
        for name in ("network_alpha", "unet_lr"):
            if data[name] is not None:
                data[name] = float(data[name])
        data["learning_rate"], data["max_grad_norm"] = float(data["learning_rate"]), float(data["max_grad_norm"])
        if data["text_encoder_lr"] is not None:
            data["text_encoder_lr"] = tuple(float(lr) for lr in data["text_encoder_lr"])
        warmup = data["lr_warmup_steps"]
        data["lr_warmup_steps"] = warmup if isinstance(warmup, int) else float(warmup)
        data["network_module"] = str(data["network_module"])
        data["network_args"] = tuple(str(entry) for entry in data["network_args"])
        data["cpu_offload_checkpointing"] = bool(data["cpu_offload_checkpointing"])
        data["torch_compile"], data["dynamo_backend"] = bool(data["torch_compile"]), str(data["dynamo_backend"])
        data["frames"] = int(data["frames"])
        for name in ("use_pinned_memory_for_block_swap", "high_noise_expert", "offload_inactive_dit",
                     "fsdp_offload_params", "shard_optimizer_state"):
            data[name] = bool(data[name])
        data["fsdp"] = str(data["fsdp"]) if data["fsdp"] else None
        return cls(**data)

    def describe(self) -> str:
        parts = [f"micro-batch {self.train_batch_size} x accum {self.gradient_accumulation_steps}",
                 f"{self.resolution[0]}x{self.resolution[1]}" + (f"x{self.frames} frames" if self.frames > 1 else ""),
                 f"rank {self.network_dim}", self.optimizer_type]
        if self.gradient_checkpointing:
            parts.append("grad-checkpointing")
        if self.cache_text_encoder_outputs:
            parts.append("TE outputs cached")
        if self.max_bucket_reso is not None:
            parts.append(f"max bucket {self.max_bucket_reso}")
        if self.fp8_base:
            parts.append("fp8 base")
        if self.high_noise_expert:
            parts.append("both experts" + (", the inactive one offloaded" if self.offload_inactive_dit else ""))
        if self.blocks_to_swap:
            parts.append(f"{self.blocks_to_swap} blocks swapped"
                         + (" (pinned)" if self.use_pinned_memory_for_block_swap else ""))
        if self.cpu_offload_checkpointing:
            parts.append("checkpoints offloaded to the CPU")
        if self.fsdp:
            groups = f", groups of {self.fsdp_shard_size}" if self.fsdp == "hybrid_shard" else ""
            parts.append(f"sharded ({self.fsdp}{groups})"
                         + (", offloaded to host RAM" if self.fsdp_offload_params else ""))
        if self.shard_optimizer_state:
            parts.append("optimizer state sharded")
        if self.torch_compile:
            parts.append(f"blocks compiled ({self.dynamo_backend})")
        parts.append(f"lr {self.learning_rate:g}")
        if self.lr_warmup_steps:
            parts.append(f"warm-up {self.lr_warmup_steps:g}")
        if not self.max_grad_norm:
            parts.append("no grad clipping")
        if self.full_fp16 or self.full_bf16:
            parts.append("full fp16" if self.full_fp16 else "full bf16")
        return ", ".join(parts)
