"""Per-family planning facts (``autotune/data/plan_profiles.json``): the search space and kohya keys as data.

The planner asks a family's profile, never its name: whether its text encoders are cached and never trained,
in which order the fallback ladder gives things up (``ladder``: named steps, see ``search.ladder``), which
separate model files its script needs (FLUX: CLIP-L, T5-XXL, AE) and which fixed keys go into config.toml.
The facts of the model itself come from the engine's family data (``sd_scripts_compat.facts.families``): its
LoRA module (``network_module``) and how many blocks it swaps (``max_blocks_to_swap``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from sd_scripts_compat.facts.families import FamilySpec

PROFILES_PATH = Path(__file__).resolve().parents[1] / "data" / "plan_profiles.json"


@dataclass(frozen=True)
class BothExperts:
    """How a profile trains two experts in one run (Wan 2.2 A14B: musubi's ``--dit_high_noise``)."""

    file_key: str  # the second expert's file option
    placeholder: str
    file_reason: str
    drop: tuple[str, ...]  # fixed keys of the one-expert plan that do not apply
    fixed: tuple[tuple[str, Any, str], ...]  # (key, value, reason) added instead


@dataclass(frozen=True)
class PlanProfile:
    network_module: str
    network_module_reason: str
    ladder: tuple[str, ...]
    train_text_encoder: bool | None  # None: the planner's usual rule (SD 1/2 yes, SDXL no)
    cache_text_encoder_outputs: bool | None  # None: the usual rule (SDXL UNet-only)
    cache_text_encoder_outputs_reason: str
    model_files: dict[str, tuple[str, str]]  # kohya key -> (placeholder path, reason)
    fixed: tuple[tuple[str, Any, str], ...]  # (kohya key, value, reason)
    max_blocks_to_swap: int
    fp8_min_compute_capability: tuple[int, int] | None = None  # None: the engine's rule (8.9+)
    fp8_reason: str | None = None
    # the largest text encoder in fp8 for the caching phase: a file (model_files' "t5xxl_fp8") or a flag
    # (HunyuanImage's fp8_vl); SD3 keeps an fp8 T5-XXL file in fp8 only under fp8_base (else it upcasts it)
    te_fp8_flag: str | None = None
    te_fp8_needs_fp8_base: bool = False
    te_cpu_flag: str | None = None  # caching on the CPU where even the fp8 encoders do not fit (text_encoder_cpu)
    # kohya key -> the prefix under which the model file itself may hold that part (SD3.5's text encoders)
    model_files_inside: dict[str, str] | None = None
    # Wan 2.2: the second expert's file (key, placeholder, reason) and the fixed keys that change when both train
    both_experts: BothExperts | None = None

    @property
    def has_te_fp8(self) -> bool:
        return "t5xxl_fp8" in self.model_files or self.te_fp8_flag is not None

    def expert_switch_share(self) -> float:
        """Two experts: the share of micro-steps that change expert under the plan's own timestep boundary and
        flow shift (``dit_speed.expert_switch_share``); 0 for a profile with one expert."""
        from autotune.estimate.dit_speed import expert_switch_share

        if self.both_experts is None:
            return 0.0
        values = {key: value for key, value, _ in (*self.fixed, *self.both_experts.fixed)}
        boundary = float(values["timestep_boundary"])
        return expert_switch_share(boundary / 1000 if boundary > 1 else boundary, float(values["discrete_flow_shift"]))

    def text_encoder_fp8(self, planned: bool, fp8_base: bool) -> bool:
        """Whether the planned fp8 text encoder is in fp8 for these settings (SD3: only under fp8_base)."""
        return planned and (fp8_base or not self.te_fp8_needs_fp8_base)


@cache
def _profiles(path: str = str(PROFILES_PATH)) -> dict[str, Any]:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def plan_profile(family: FamilySpec) -> PlanProfile:
    """The profile of ``family`` (a family listed under a profile's ``families``), else ``default``."""
    data = _profiles()
    entry = next((p for k, p in data.items() if k != "_doc" and family.name in p.get("families", ())),
                 data["default"])
    return PlanProfile(
        network_module=family.network_module,
        network_module_reason=entry.get("network_module_reason",
                                        "kohya's LoRA (LierLa: linear layers of attention and MLPs)"),
        ladder=tuple(entry["ladder"]), train_text_encoder=entry.get("train_text_encoder"),
        cache_text_encoder_outputs=entry.get("cache_text_encoder_outputs"),
        cache_text_encoder_outputs_reason=entry.get("cache_text_encoder_outputs_reason", ""),
        model_files={k: (v[0], v[1]) for k, v in entry.get("model_files", {}).items()},
        fixed=tuple((k, v, r) for k, v, r in entry.get("fixed", ())),
        max_blocks_to_swap=family.max_blocks_to_swap,
        fp8_min_compute_capability=(tuple(int(x) for x in entry["fp8_min_compute_capability"].split("."))
                                    if "fp8_min_compute_capability" in entry else None),  # type: ignore[arg-type]
        fp8_reason=entry.get("fp8_reason"), te_fp8_flag=entry.get("te_fp8_flag"),
        te_fp8_needs_fp8_base=entry.get("te_fp8_needs_fp8_base", False), te_cpu_flag=entry.get("te_cpu_flag"),
        model_files_inside=entry.get("model_files_inside"), both_experts=_both_experts(entry.get("both_experts")),
    )


def _both_experts(entry: dict[str, Any] | None) -> BothExperts | None:
    if entry is None:
        return None
    key, placeholder, reason = entry["model_file"]
    return BothExperts(file_key=key, placeholder=placeholder, file_reason=reason, drop=tuple(entry["drop"]),
                       fixed=tuple((k, v, r) for k, v, r in entry["fixed"]))


FP8_FILE_KEY = "t5xxl_fp8"  # the fp8 choice of t5xxl, not an option of its own


def model_file_keys() -> tuple[str, ...]:
    """Every kohya key naming a separate model file in any family (clip_l, t5xxl, ae, clip_g, gemma2, ...): the
    command line's ``--KEY FILE`` options."""
    keys = [k for entry in _profiles().values() if isinstance(entry, dict)
            for k in [*entry.get("model_files", {}), *entry.get("both_experts", {}).get("model_file", [])[:1]]
            if k != FP8_FILE_KEY]
    return tuple(dict.fromkeys(keys))
