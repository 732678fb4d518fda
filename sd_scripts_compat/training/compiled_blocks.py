"""``torch_compile``: each repeated block of the denoiser compiled on its own, eager again if compiling fails.

sd-scripts' ``--torch_compile`` / ``--dynamo_backend`` hand the whole UNet to accelerate, which compiles it as one
graph: minutes of compile time, and a new compile for every new bucket size. Compiling each repeated block
instead (UNet down / mid / up blocks, DiT transformer blocks) keeps each graph small, so the compile is short and
blocks of the same shape share their compiled code; a second bucket size recompiles a block once with dynamic
sizes (torch's automatic dynamic shapes), not once per size. The LoRA modules are plain modules inside the
blocks, so they are traced with them; gradient checkpointing and block swap work on the compiled blocks as on
eager ones. A block whose compile fails (dynamo cannot trace it, the backend raises) says so in one line, and
every block runs eager from then on; the step that hit the failure runs its block eagerly.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sd_scripts_compat.facts.contract import is_oom_error

if TYPE_CHECKING:
    import torch

BLOCK_LISTS = ("down_blocks", "up_blocks", "transformer_blocks", "single_transformer_blocks", "joint_blocks")
SINGLE_BLOCKS = ("mid_block",)


def repeated_blocks(denoiser: torch.nn.Module) -> list[tuple[str, Any]]:
    """The denoiser's repeated blocks, each with its module name (``down_blocks.0``, ``mid_block``, ...)."""
    blocks = [(f"{name}.{i}", block) for name in BLOCK_LISTS for i, block in enumerate(getattr(denoiser, name, ()))]
    return blocks + [(name, getattr(denoiser, name)) for name in SINGLE_BLOCKS
                     if getattr(denoiser, name, None) is not None]


@dataclass
class CompiledBlocks:
    """The compiled blocks of one run: how many, with which backend, the seconds spent compiling them (recompiles
    included), and whether they fell back to eager."""

    backend: str
    blocks: list[tuple[str, Any]] = field(default_factory=list)
    failure: str | None = None
    spans: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of each compile, host clock
    _open: list[float] = field(default_factory=list)  # the start of the compile under way (nested ones inside it)

    @property
    def seconds(self) -> float:
        return sum(end - start for start, end in self.spans)

    def compile_begun(self, *_: object) -> None:
        self._open.append(time.time())

    def compile_ended(self, *_: object) -> None:
        began = self._open.pop() if self._open else None
        if began is not None and not self._open:
            self.spans.append((began, time.time()))

    def compiled_between(self, start: float, end: float) -> bool:
        """Whether a compile ran in [start, end] (a step that compiled is no measure of the compiled step)."""
        return any(began < end and ended > start for began, ended in self.spans)

    def fall_back(self, block_name: str, error: BaseException) -> None:
        """Every block eager from now on; one line says which block failed and why."""
        if self.failure is not None:
            return
        self.failure = f"{block_name}: {type(error).__name__}: {_first_line(error)}"
        for _, block in self.blocks:
            block._compiled_call_impl = None
        warnings.warn(f"torch_compile ({self.backend}) failed on {self.failure}; training continues eager (remove "
                      "torch_compile to skip the attempt)", stacklevel=2)


def compile_blocks(denoiser: torch.nn.Module, backend: str) -> CompiledBlocks:
    """Compile each repeated block of ``denoiser`` lazily (at its first call) with ``backend``."""
    import torch._dynamo
    from torch._dynamo.callback import on_compile_end, on_compile_start

    compiled = CompiledBlocks(backend=backend, blocks=repeated_blocks(denoiser))
    on_compile_start(compiled.compile_begun)
    on_compile_end(compiled.compile_ended)
    # dynamo's limit of 8 compiled versions is per code object, and blocks of one class share their forward's: an
    # SD1.5 UNet's 9 blocks, or a second bucket size, would leave blocks past the 8th eager with a log warning
    limit = 2 * len(compiled.blocks) + 8
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
    for name, block in compiled.blocks:
        try:
            block.compile(backend=backend)
        except Exception as error:  # noqa: BLE001 - a backend that cannot be set up: eager, one line
            if not is_compile_failure(error):
                raise
            compiled.fall_back(name, error)
            break
        block._compiled_call_impl = _guarded(name, block, block._compiled_call_impl, compiled)
    return compiled


def report_compiles(listener: Callable[[bool], None]) -> None:
    """Call ``listener(True)`` when dynamo starts compiling a graph and ``listener(False)`` when it ends: the engine
    says "compiling" to its watchdog, whose stall limit for a training step is far shorter than a compile."""
    from torch._dynamo.callback import on_compile_end, on_compile_start

    on_compile_start(lambda *_: listener(True))
    on_compile_end(lambda *_: listener(False))


def _guarded(name: str, block: torch.nn.Module, compiled_call: Callable[..., Any],
             compiled: CompiledBlocks) -> Callable[..., Any]:
    """The block's compiled call; a compile failure switches every block to eager and runs this one eagerly."""

    def call(*args: object, **kwargs: object) -> object:
        try:
            return compiled_call(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - compile failures fall back; everything else re-raises
            if not is_compile_failure(error):
                raise
            compiled.fall_back(name, error)
            return block._call_impl(*args, **kwargs)

    return call


def is_compile_failure(error: BaseException) -> bool:
    """dynamo could not trace the block or the backend failed on its graph (inductor's errors arrive wrapped in
    ``BackendCompilerFailed``); an out-of-memory error is never one."""
    from torch._dynamo.exc import TorchDynamoException

    return isinstance(error, TorchDynamoException) and not is_oom_error(error)


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process (a block's first compile and each recompile count one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return " ".join(text[0].split())[:200] if text else ""


def compile_summary(compiled: CompiledBlocks | None) -> dict[str, Any] | None:
    """done.json's ``torch_compile``: the backend, blocks compiled, graphs compiled in all (recompiles included),
    seconds spent compiling them, and the failure that sent the blocks back to eager, if one did."""
    if compiled is None:
        return None
    return {"backend": compiled.backend, "blocks": len(compiled.blocks), "graphs": graphs_compiled(),
            "seconds": round(compiled.seconds, 3), "failure": compiled.failure}
