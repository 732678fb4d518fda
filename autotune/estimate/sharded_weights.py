"""The weights one process holds when the engine shards the denoiser (``training.sharding``, FSDP2): one rule for
the transformer families and the UNets, which differ only in their units.

Each process holds 1/N of every parameter and every buffer whole; the root unit (the parameters outside the units)
stays gathered through the step; the backward gathers each unit again and prefetches the one before it, so a pair of
neighbouring units is in flight while the saved activations are at their largest. Without checkpointing that is
where the backward starts (the activations fall by a whole unit's with each unit after). With it (``checkpoint_bytes``:
one unit's saved input) they fall by that much per unit only, so a larger pair deeper in may be the peak: the pair
``k`` units in, less the ``k - 1`` inputs freed by then. Traced with the engine's sharding on a fake process group
(``bench/sharded_trace.py``).
"""

from __future__ import annotations


def sharded_bytes(units: list[int], root: int, buffers: int, ranks: int,
                  checkpoint_bytes: int | None = None) -> tuple[int, int]:
    """(bytes each of ``ranks`` processes holds, bytes gathered in flight at the step's peak) of a denoiser of
    ``units`` (bytes each, in forward order), ``root`` parameter bytes outside them and ``buffers`` bytes."""
    backward = units[::-1]
    pairs = [a + b for a, b in zip(backward, backward[1:])] or units
    in_flight = pairs[0] if checkpoint_bytes is None else \
        max(pair - max(0, k - 1) * checkpoint_bytes for k, pair in enumerate(pairs))
    return -(-(sum(units) + root) // ranks) + buffers, root + in_flight


def gathered_bytes(units: list[int], root: int, ranks: int, offload: bool = False) -> int:
    """Bytes each process receives per micro-step: every unit gathered for the forward and again for the backward,
    and the root once, each process getting the (N - 1) / N it does not hold; with ``offload`` its own 1 / N too,
    copied from host RAM before each gather (the same host link on consumer cards)."""
    moved = 2 * sum(units) + root
    return int(moved * (ranks - 1) / ranks + (moved / ranks if offload else 0))


def state_sync_bytes(lora_bytes: int, ranks: int) -> float:
    """Bytes each process receives per optimizer step with ``shard_optimizer_state``: the (N - 1) / N of the LoRA's
    parameters it does not own, sent by their owners after the update (with nothing to hide behind)."""
    return lora_bytes * (ranks - 1) / ranks
