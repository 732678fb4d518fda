"""Live tensor bytes of a process, counted per dispatched op: the peak a CUDA card's ``max_memory_allocated``
would show, measurable on any device.

Used by the calibration tracers (on fake tensors: the memory model's ground truth) and by the emulated card
(``training.emulated_card``: on the real tensors of a CPU run, with a limit past which it raises an OOM).
Hand-written because torch's MemTracker is ~10x slower here and needs patching for frozen params.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode


class LiveBytesCounter:
    """A dispatch mode that tracks the bytes of live tensor storages and their peak.

    Every tensor an op returns has its storage registered once (views share a storage, so they add
    nothing); a weakref callback subtracts the storage when it dies. Works the same on real and on
    fake tensors, which is how the tests check the fake figure against a real run.
    With ``limit`` (bytes), an op that leaves more live bytes than that raises ``torch.OutOfMemoryError``, as
    a card of that size would.
    """

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self.current = 0
        self.peak = 0
        self.phase = "setup"
        self.peak_phase = "setup"
        self.phase_peaks: dict[str, int] = {}
        self._live: dict[int, tuple[int, Any]] = {}

    def register(self, tensors: Iterable[Any]) -> None:
        """Count storages that exist before tracing starts (parameters, buffers, inputs)."""
        for tensor in tensors:
            self._track(tensor)
        self._update_peak()

    def reset_peak(self) -> None:
        self.peak = self.current
        self.peak_phase = self.phase

    def _track(self, tensor: torch.Tensor) -> None:
        import torch

        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._live:
            return
        nbytes = storage.nbytes()
        self._live[key] = (nbytes, weakref.ref(storage, self._finalizer(key)))
        self.current += nbytes

    def resized(self, tensor: torch.Tensor) -> None:
        """``tensor``'s storage was resized in place (FSDP frees a gathered weight so, keeping the tensor): count
        its bytes now."""
        storage = tensor.untyped_storage()
        entry = self._live.get(storage._cdata)
        if entry is None:
            self._track(tensor)
        else:
            self._live[storage._cdata] = (storage.nbytes(), entry[1])
            self.current += storage.nbytes() - entry[0]
        self._update_peak()

    def _finalizer(self, key: int) -> Callable[[Any], None]:
        def release(_ref: object) -> None:
            entry = self._live.get(key)
            if entry is not None and entry[1] is _ref:
                del self._live[key]
                self.current -= entry[0]  # its bytes now (``resized``), not at birth

        return release

    def _update_peak(self) -> None:
        if self.current > self.phase_peaks.get(self.phase, -1):
            self.phase_peaks[self.phase] = self.current
        if self.current > self.peak:
            self.peak = self.current
            self.peak_phase = self.phase
        if self.limit is not None and self.current > self.limit:
            import torch

            raise torch.OutOfMemoryError(
                f"out of memory on the emulated card: {self.current / 2**20:.2f} MiB of tensors live, the card "
                f"holds {self.limit / 2**20:.2f} MiB")

    def mode(self) -> TorchDispatchMode:
        """The ``TorchDispatchMode`` that feeds this counter (entered outermost, after FakeTensorMode)."""
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                out = func(*args, **(kwargs or {}))
                for leaf in tree_leaves(out):
                    counter._track(leaf)
                counter._update_peak()
                return out

        return _Mode()
