"""Which of this machine's cards NVLink joins, as the planner's speed model reads it: the collectives of a sharded
or data-parallel run cross NVLink only where every pair of the cards taking part is linked, else the slowest hop
(PCIe through the host) sets their pace. Read once from the probe's peer links (``probe._read_peer_links``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autotune.hardware.probe import GpuInfo


def nvlinked_blocks(gpus: list[GpuInfo]) -> tuple[int, float | None]:
    """(g, GB/s): the largest g that splits the cards, in their order, into blocks of g whose every pair NVLink joins
    with a known speed (two bridged RTX 3090 pairs: 2; eight cards on an NVSwitch: 8), and the GB/s each way the
    least-linked card's NVLinks carry to the rest of its block; (1, None) where none is."""
    found: tuple[int, float | None] = (1, None)
    for size in range(2, len(gpus) + 1):
        if len(gpus) % size:
            continue
        rates = [_into_block(card, gpus[start:start + size]) for start in range(0, len(gpus), size)
                 for card in gpus[start:start + size]]
        if all(rate is not None for rate in rates):
            found = (size, min(rate for rate in rates if rate is not None))
    return found


def _into_block(card: GpuInfo, block: list[GpuInfo]) -> float | None:
    peers = {peer.gpu: peer.nvlink_gbps for peer in card.peers or []}
    rates = [peers.get(other.index) for other in block if other.index != card.index]
    return None if any(rate is None for rate in rates) else sum(rate for rate in rates if rate is not None)


def collective_gbps(gpu: Any, ranks: int, default_pcie_gbps: float) -> float:
    """GB/s each way a collective among ``ranks`` consecutive processes moves at on ``gpu``'s machine (a
    ``GpuSpec``): NVLink's where the NVLinked blocks hold whole groups of them (the groups of ``hybrid_shard``, or
    every card), scaled to the peers a group has in its block (a direct-link count; an NVSwitch gives more), else
    the card's PCIe link (or ``default_pcie_gbps``)."""
    block, nvlink = getattr(gpu, "nvlink_group", 1) or 1, getattr(gpu, "nvlink_gbps", None)
    if nvlink and 1 < ranks <= block and block % ranks == 0:
        return nvlink * (ranks - 1) / (block - 1)
    return getattr(gpu, "pcie_gbps", None) or default_pcie_gbps
