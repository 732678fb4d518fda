"""``blocks_to_swap``: keep some transformer blocks' frozen weights in host memory, copy them in around use.

Each swapped block rests in (pinned, on CUDA) host memory. Just before its forward its weights are copied
into a fresh device buffer; the copy of the next swapped block starts at once on a side CUDA stream
(an event orders it before that block's compute), so copying overlaps compute. After the forward the
device copy is dropped (the weights are frozen: nothing is copied back). Backward needs the weights again,
in reverse order: the block's outputs pass through a small autograd function whose backward copies the block
in again (and prefetches the one before it), its inputs through one whose backward drops it. Without
gradient checkpointing autograd would keep views of the device weights alive until backward and so undo the
saving: saved-tensor hooks store "weight i of block b" instead and read it back from the fresh copy. With
checkpointing (diffusers' non-reentrant checkpoint) the recomputed forward runs inside the held block.
On CPU the same path runs with plain copies into a separate staging buffer, so tests see the mechanism.

Hand-written because accelerate's and diffusers' offloading hooks move whole modules synchronously and
do not bring blocks back for backward; sd-scripts' version is tied to its own model classes. FLUX.1 counts
``blocks_to_swap`` in double-block units, as sd-scripts: n // 2 double blocks and 2 * (n - n // 2) single
blocks, the last of each list. sd-scripts keeps two of each list resident (its swap rotates blocks through
them), hence its limit of 35 for FLUX.1. That rule is the family's data (``FamilySpec.swap_split``, read by
the config reader, the memory model, the planner and the OOM ladder alike); this swapper needs no resident
block, so a model without family data (a test model) may swap all of its blocks.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import FamilySpec, swap_split

if TYPE_CHECKING:
    import torch


@dataclass
class SwapStats:
    """What the swapper did (tests and benchmarks read it)."""

    blocks_in: int = 0  # block copies host -> device
    bytes_in: int = 0
    backward_swaps: int = 0  # of those, for a backward pass


@dataclass
class _Slot:
    index: int
    module: Any
    params: list[Any]
    masters: list[Any]  # the resting copies, in host memory
    resident: bool = False
    held: bool = False  # swapped in for its backward: the (re)computed forward must not drop it
    event: Any = None
    storages: dict[int, int] = field(default_factory=dict)  # device storage pointer -> parameter index


class BlockSwap:
    """Swaps ``swapped`` (indices into ``blocks``, the forward order) between host and ``device``."""

    def __init__(self, blocks: Sequence[Any], swapped: Sequence[int], device: str | torch.device,
                 checkpointing: Callable[[], bool] = lambda: False) -> None:
        import torch

        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.checkpointing = checkpointing
        self.stats = SwapStats()
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self._callback_queued = False
        self.order = sorted(set(swapped))
        self.slots: dict[int, _Slot] = {}
        for index in self.order:
            module = blocks[index]
            params = [p for p in module.parameters()] + [b for b in module.buffers()]
            masters = [self._master(p) for p in params]
            slot = _Slot(index=index, module=module, params=params, masters=masters)
            for param, master in zip(params, masters):
                param.data = master
            self.slots[index] = slot
            module.forward = self._wrap(slot, module.forward)

    def _master(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch

        host = tensor.detach().to("cpu")
        if self.cuda:
            pinned = torch.empty_like(host, pin_memory=True)
            pinned.copy_(host)
            return pinned
        return host

    # ---- moving weights ---------------------------------------------------------------------------

    def _swap_in(self, slot: _Slot) -> None:
        """Start copying ``slot`` in (on the side stream on CUDA); :meth:`_ready` waits for it."""
        import torch

        if slot.resident:
            return
        context = torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()
        staged = []
        with context:
            for master in slot.masters:
                copy = torch.empty_like(master, device=self.device)
                copy.copy_(master, non_blocking=self.cuda)
                staged.append(copy)
            if self.cuda:
                slot.event = torch.cuda.Event()
                slot.event.record(self.stream)
        slot.storages = {copy.untyped_storage().data_ptr(): i for i, copy in enumerate(staged)}
        for param, copy in zip(slot.params, staged):
            param.data = copy
        slot.resident = True
        self.stats.blocks_in += 1
        self.stats.backward_swaps += int(self._callback_queued)  # queued from the first backward swap-in on
        self.stats.bytes_in += sum(m.numel() * m.element_size() for m in slot.masters)

    def _ready(self, slot: _Slot) -> None:
        """``slot`` is resident and its copy finished before the compute stream uses it."""
        import torch

        self._swap_in(slot)
        if self.cuda and slot.event is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(slot.event)
            for param in slot.params:
                param.data.record_stream(compute)  # allocated on the side stream, used and freed on this one
            slot.event = None

    def _swap_out(self, slot: _Slot) -> None:
        if not slot.resident:
            return
        for param, master in zip(slot.params, slot.masters):
            param.data = master
        slot.resident, slot.held, slot.storages = False, False, {}

    def _neighbour(self, index: int, step: int) -> _Slot | None:
        position = self.order.index(index) + step
        return self.slots[self.order[position]] if 0 <= position < len(self.order) else None

    # ---- hooks ------------------------------------------------------------------------------------

    def _wrap(self, slot: _Slot, forward: Callable[..., Any]) -> Callable[..., Any]:
        import torch

        def swapped_forward(*args: object, **kwargs: object) -> object:
            self._ready(slot)
            upcoming = self._neighbour(slot.index, +1)
            if upcoming is not None and not slot.held:
                self._swap_in(upcoming)  # overlaps this block's compute
            training = torch.is_grad_enabled()
            if training:
                args, kwargs = self._mark_inputs(slot, args, kwargs)
            hooks = self._saved_tensor_hooks(slot) if training and not self.checkpointing() else \
                contextlib.nullcontext()
            with hooks:
                output = forward(*args, **kwargs)
            if training:
                output = self._mark_outputs(slot, output)
            if not slot.held:
                self._swap_out(slot)
            return output

        return swapped_forward

    def _saved_tensor_hooks(self, slot: _Slot) -> torch.autograd.graph.saved_tensors_hooks:
        import torch

        def pack(tensor: torch.Tensor) -> torch.Tensor | _WeightView:
            index = slot.storages.get(tensor.untyped_storage().data_ptr()) if slot.resident else None
            if index is None or tensor.dtype != slot.params[index].dtype:
                return tensor
            return _WeightView(index, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())

        def unpack(packed: torch.Tensor | _WeightView) -> torch.Tensor:
            if not isinstance(packed, _WeightView):
                return packed
            if not slot.resident:
                raise RuntimeError(f"block swap: block {slot.index} is not on the device for its backward")
            index, shape, stride, offset = packed
            return slot.params[index].data.as_strided(shape, stride, offset)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _mark_inputs(self, slot: _Slot, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        import torch

        names = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
        positions = [i for i, v in enumerate(args) if isinstance(v, torch.Tensor) and v.requires_grad]
        if not names and not positions:
            return args, kwargs
        tensors = [args[i] for i in positions] + [kwargs[k] for k in names]
        marked = _call_on_backward().apply(lambda: self.after_backward_of(slot), *tensors)
        marked = marked if isinstance(marked, tuple) else (marked,)
        replaced = list(args)
        for i, tensor in zip(positions, marked):
            replaced[i] = tensor
        kwargs = {**kwargs, **dict(zip(names, marked[len(positions):]))}
        return tuple(replaced), kwargs

    def _mark_outputs(self, slot: _Slot, output: object) -> object:
        import torch

        items = list(output) if isinstance(output, tuple) else [output]
        positions = [i for i, v in enumerate(items) if isinstance(v, torch.Tensor) and v.requires_grad]
        if not positions:
            return output
        marked = _call_on_backward().apply(lambda: self.before_backward_of(slot), *[items[i] for i in positions])
        marked = marked if isinstance(marked, tuple) else (marked,)
        for i, tensor in zip(positions, marked):
            items[i] = tensor
        return tuple(items) if isinstance(output, tuple) else items[0]

    def before_backward_of(self, slot: _Slot) -> None:
        """The gradient of the block's outputs arrived: bring it in (held) and prefetch the block before it."""
        import torch

        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.release_all)
        self._ready(slot)
        slot.held = True
        previous = self._neighbour(slot.index, -1)
        if previous is not None:
            self._swap_in(previous)

    def after_backward_of(self, slot: _Slot) -> None:
        self._swap_out(slot)

    def release_all(self) -> None:
        """End of a backward pass (or of an interrupted step): every block back to host memory."""
        self._callback_queued = False
        for slot in self.slots.values():
            self._swap_out(slot)

    def resident_blocks(self) -> list[int]:
        return [slot.index for slot in self.slots.values() if slot.resident]


class _WeightView(NamedTuple):
    """A saved tensor that is (a view of) a swapped block's weight: which weight, and the view's geometry."""

    weight: int  # the slot's parameter index
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int | torch.SymInt


@functools.cache
def _call_on_backward() -> type[torch.autograd.Function]:
    """An autograd identity whose backward first calls ``hook()``: it marks where a block's backward begins
    (its outputs) and ends (its inputs). Built once, lazily, so torch is imported only when training."""
    import torch

    class CallOnBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, hook: Callable[[], None],  # type: ignore[override]  # autograd's ctx takes attributes
                    *tensors: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
            ctx.hook = hook
            ctx.set_materialize_grads(False)
            out = tuple(t.view_as(t) for t in tensors)
            return out if len(out) > 1 else out[0]

        @staticmethod
        def backward(ctx: Any, *grads: object) -> tuple[object, ...]:  # type: ignore[override]
            ctx.hook()
            return (None, *grads)

    return CallOnBackward


def check_blocks_to_swap(family: FamilySpec, blocks_to_swap: int) -> tuple[int, int]:
    """The engine's answer to a config's ``blocks_to_swap`` for a model of ``family``: its (double, single)
    split, or a one-line UserError (a family that cannot swap, or more blocks than its rule allows)."""
    if blocks_to_swap and family.swap_block_counts == (0, 0):
        raise UserError(f"blocks_to_swap = {blocks_to_swap}: {family.name} does not swap blocks (FLUX.1 "
                        "transformers do); remove blocks_to_swap")
    return family.swap_split(blocks_to_swap)  # its blocks as loaded: a pruned model swaps fewer


def enable_flux_block_swap(transformer: torch.nn.Module, blocks_to_swap: int, device: str | torch.device,
                           family: FamilySpec | None = None) -> BlockSwap | None:
    """Swap the last blocks of a diffusers transformer (the family's ``transformer_block_groups``: FLUX's
    ``transformer_blocks`` then ``single_transformer_blocks``, Lumina's ``layers`` ...) as ``family``'s rule splits
    ``blocks_to_swap`` (without a family: FLUX's two lists by the model's own counts, none kept resident); call it
    with the model on the CPU and let :func:`place_except_swapped` move the rest, so the swapped blocks never
    occupy the device at once."""
    if not blocks_to_swap:
        return None
    names = [group["modules"] for group in family.transformer_block_groups] if family is not None else \
        ["transformer_blocks", "single_transformer_blocks"]
    lists = [list(getattr(transformer, name, ())) for name in names] + [[]]
    doubles, singles = lists[0], lists[1]
    n_double, n_single = family.swap_split(blocks_to_swap) if family is not None else \
        swap_split(blocks_to_swap, len(doubles), len(singles))
    blocks = doubles + singles
    swapped = list(range(len(doubles) - n_double, len(doubles))) + \
        list(range(len(blocks) - n_single, len(blocks)))
    return BlockSwap(blocks, swapped, device, checkpointing=lambda: bool(transformer.gradient_checkpointing))


def place_except_swapped(model: torch.nn.Module, swap: BlockSwap | None, device: str | torch.device,
                         dtype: torch.dtype) -> None:
    """Cast ``model`` to ``dtype`` and move it to ``device``, except the swapped blocks (they rest on the host)."""
    import torch

    skip = {id(t) for slot in swap.slots.values() for t in slot.params} if swap is not None else set()
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) in skip:
            continue
        target = dtype if tensor.is_floating_point() and tensor.dtype != getattr(torch, "float8_e4m3fn", None) \
            else tensor.dtype
        tensor.data = tensor.data.to(device=device, dtype=target)
