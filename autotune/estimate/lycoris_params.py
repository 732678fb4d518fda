"""LyCORIS parameter tensors for the memory model, counted by lycoris-lora itself.

LoHa holds four factors per module (twice LoCon's parameters at the same rank), LoKr a Kronecker pair whose
sizes follow its ``factor`` and whether a side is small enough to keep whole; the package decides all of
this, so the count builds the network with it on the family's full-size model on the meta device (the base
weights are never allocated; the LyCORIS tensors, a few hundred MB at most, are) and reads the shapes.
Why not an analytic table as for LoRA: the rules are lycoris-lora's and change with its releases.
Activations are not counted here: the memory model keeps LoRA's and says so.
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=16)
def lycoris_tensor_sizes(family: str, rank: int, network_args: tuple[str, ...],
                         train_text_encoder: bool) -> tuple[tuple[int, int], ...]:
    """(elements, count) of every trainable LyCORIS tensor for ``family`` at ``rank`` with ``network_args``
    (``("algo=lokr", "factor=8")``), text encoders included when trained."""
    from collections import Counter

    from sd_scripts_compat.config.network_args import LYCORIS_MODULE, parse_network_args
    from sd_scripts_compat.facts.families import get_family
    from sd_scripts_compat.models.build import build_modules
    from sd_scripts_compat.network.lycoris import create_lycoris_network

    entries = dict(entry.split("=", 1) for entry in network_args)
    args = parse_network_args(entries, LYCORIS_MODULE)
    bundle = build_modules(get_family(family), device="meta")
    network = create_lycoris_network(bundle, network_dim=rank, network_alpha=rank, dropout=None, args=args,
                                     train_text_encoder=train_text_encoder, quiet=True)
    network.apply_to()
    sizes = Counter(param.numel() for param in network.inner.parameters() if param.requires_grad)
    return tuple(sorted(sizes.items()))
