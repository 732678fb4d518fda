"""How a musubi-tuner plan's host side runs, decided once the search has found the fewest swapped blocks that
fit the card (the search decides what fits; this decides, from the same memory and speed models, where the
weights that do not fit wait):

- ``use_pinned_memory_for_block_swap``: the swapped blocks live in page-locked RAM, so their copies skip the
  staging buffer (``dit_speed``: ``pinned_link_efficiency`` against pageable ``link_efficiency``). On only where
  it makes the micro-step faster (the copies bound it; where they hide behind the compute, pinning only locks RAM
  the OS cannot page out), the machine's RAM is known, the run fits it, and the pinned bytes stay within half of
  it (Windows counts page-locked memory as shared GPU memory, capped at half the RAM).
- Wan 2.2 with both experts: both experts' blocks swapped, or ``offload_inactive_dit`` (the inactive expert whole
  in host RAM, moved in when the sampled timestep crosses the boundary; musubi allows no block swap with it):
  the faster of the two that fit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autotune.planning.profiles import plan_profile
from autotune.planning.request import GIB
from autotune.planning.search import Predictor, Scored, score


@dataclass(frozen=True)
class HostSwapChoice:
    chosen: Scored
    pinned_reason: str | None = None  # None: nothing is swapped, nothing to pin
    offload_reason: str | None = None  # None: one expert


def decide_host_swap(chosen: Scored, predictor: Predictor, *, usable: int, host_ram: int | None) -> HostSwapChoice:
    """The chosen settings with the two host-side choices made, and why (``host_ram``: RAM the run may use,
    None when unknown)."""
    offload_reason = pinned_reason = None
    if chosen.settings.high_noise_expert:
        chosen, offload_reason = _experts(chosen, predictor, usable, host_ram)
    if chosen.settings.blocks_to_swap:
        chosen, pinned_reason = _pinned(chosen, predictor, host_ram)
    return HostSwapChoice(chosen=chosen, pinned_reason=pinned_reason, offload_reason=offload_reason)


def _seconds(s: Scored) -> float:
    return 1.0 / s.it_per_s


def _experts(chosen: Scored, predictor: Predictor, usable: int, host_ram: int | None) -> tuple[Scored, str]:
    s = chosen.settings
    if not s.blocks_to_swap:
        return chosen, ("both experts fit on the card: switching between them re-points tensors, nothing crosses "
                        "the host link")
    alt = score(replace(s, blocks_to_swap=0, offload_inactive_dit=True, use_pinned_memory_for_block_swap=False),
                predictor)
    both = f"both experts swap {s.blocks_to_swap} blocks each"
    if alt.required > usable:
        return chosen, (f"{both}: offloading the inactive expert instead (musubi's offload_inactive_dit, no block "
                        f"swap) would need {alt.required / GIB:.1f} GiB on the card, {usable / GIB:.1f} usable")
    if host_ram is not None and alt.host_ram > host_ram:
        return chosen, (f"{both}: offloading the inactive expert instead fits the card but needs "
                        f"{alt.host_ram / GIB:.1f} GiB of RAM, {host_ram / GIB:.1f} usable")
    share = plan_profile(predictor.family).expert_switch_share()
    if alt.it_per_s > chosen.it_per_s * (1 + 1e-9):
        return alt, (f"the inactive expert waits whole in host RAM and comes in when the sampled timestep crosses "
                     f"the boundary (~{share:.0%} of micro-steps): {_seconds(alt):.2f} s per micro-step against "
                     f"{_seconds(chosen):.2f} s with {s.blocks_to_swap} blocks of each expert swapped "
                     f"(~{alt.host_ram / GIB:.0f} GiB RAM)")
    return chosen, (f"{both}: faster than offloading the inactive expert ({_seconds(chosen):.2f} against "
                    f"{_seconds(alt):.2f} s per micro-step: offloading moves a whole expert each way when the "
                    f"sampled timestep crosses the boundary, ~{share:.0%} of micro-steps)")


def _pinned(chosen: Scored, predictor: Predictor, host_ram: int | None) -> tuple[Scored, str]:
    from autotune.estimate.dit_memory import dit_inputs_for_settings, predict_dit_memory

    s = chosen.settings
    alt = score(replace(s, use_pinned_memory_for_block_swap=True), predictor)
    pinned = predict_dit_memory(dit_inputs_for_settings(predictor.family, alt.settings)).pinned_host_bytes
    if alt.it_per_s <= chosen.it_per_s * (1 + 1e-9):
        return chosen, (f"off: the swapped blocks' copies hide behind the compute ({_seconds(chosen):.2f} s per "
                        f"micro-step either way), so pinning would only lock {pinned / GIB:.1f} GiB of RAM")
    faster = f"{_seconds(chosen):.2f} -> {_seconds(alt):.2f} s per micro-step"
    if host_ram is None:
        return chosen, (f"off: pinning would make the copies faster ({faster}) but locks {pinned / GIB:.1f} GiB of "
                        "RAM, and this plan does not know the machine's RAM (plan on it, or give --ram GB)")
    if 2 * pinned > host_ram or alt.host_ram > host_ram:
        return chosen, (f"off: pinning would make the copies faster ({faster}) but lock {pinned / GIB:.1f} GiB of "
                        f"the {host_ram / GIB:.1f} GiB RAM usable (at most half may be page-locked)")
    return alt, (f"the swapped blocks' copies bound the step; page-locked they skip the staging copy: {faster}, "
                 f"{pinned / GIB:.1f} GiB of the {host_ram / GIB:.1f} GiB RAM usable locked")
