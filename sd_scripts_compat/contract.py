"""Out-of-memory detection, OOM event files and deterministic fault injection.

The watchdog (``autotune run``) talks to the engine only through a child process: exit codes,
small JSON event files and saved states. This module is the engine's side of that contract.

Exit codes: 0 done, 2 bad input (UserError), ``OOM_EXIT_CODE`` out of memory (an ``oom.json``
event says where and with which settings), 130 interrupted (state saved).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from sd_scripts_compat.atomic import write_json_atomic  # noqa: F401 - part of the event contract

OOM_EXIT_CODE = 87
INTERRUPTED_EXIT_CODE = 130
INJECT_ENV = "SD_COMPAT_INJECT_OOM"

# Messages that are an out-of-memory condition in other clothes (CUDA, cuBLAS, cuDNN, CPU, ROCm, MPS).
_OOM_PATTERNS = re.compile(
    r"out of memory|CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_NOT_SUPPORTED|CUDNN_STATUS_ALLOC_FAILED"
    r"|DefaultCPUAllocator: can't allocate memory|HIP error: out of memory|hipErrorOutOfMemory"
    r"|MPS backend out of memory|Invalid buffer size"
    r"|could not create a primitive|std::bad_alloc",  # oneDNN / C++ allocations failing under a memory limit
    re.IGNORECASE,
)


def is_oom_error(error: BaseException) -> bool:
    """True for torch.OutOfMemoryError and for RuntimeErrors whose message is an OOM in disguise."""
    try:
        import torch

        if isinstance(error, torch.OutOfMemoryError):
            return True
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return isinstance(error, (RuntimeError, MemoryError)) and (
        isinstance(error, MemoryError) or bool(_OOM_PATTERNS.search(str(error)))
    )


def memory_figures() -> dict[str, float]:
    """What memory the process used, in MiB: CUDA peaks when on a GPU, else resident set size."""
    import resource

    import torch

    figures: dict[str, float] = {}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        figures["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
        figures["cuda_max_reserved_mib"] = torch.cuda.max_memory_reserved() / 2**20
        free, total = torch.cuda.mem_get_info()
        figures["cuda_free_mib"] = free / 2**20
        figures["cuda_total_mib"] = total / 2**20
    figures["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return figures


@dataclass(frozen=True)
class OomInjector:
    """Raises a real ``torch.OutOfMemoryError`` on demand, so the OOM ladder is testable on CPU.

    ``SD_COMPAT_INJECT_OOM`` holds comma-separated rules:
      ``step=N``           raise once when global step N is about to run (a marker file in
                           ``marker_dir`` makes it fire once, even across restarts);
      ``pixels_gt=P``      raise whenever micro-batch x height x width (in pixels) exceeds P.
    """

    steps: frozenset[int]
    pixels_gt: int | None
    marker_dir: Path | None

    @classmethod
    def from_env(cls, marker_dir: Path | None, environ: dict[str, str] | None = None) -> OomInjector | None:
        spec = (environ if environ is not None else os.environ).get(INJECT_ENV, "").strip()
        if not spec:
            return None
        steps: set[int] = set()
        pixels_gt = None
        for rule in filter(None, (part.strip() for part in spec.split(","))):
            key, _, value = rule.partition("=")
            if key == "step" and value.isdigit():
                steps.add(int(value))
            elif key == "pixels_gt" and value.isdigit():
                pixels_gt = int(value)
            else:
                raise ValueError(f"{INJECT_ENV}: cannot read rule {rule!r} (use step=N or pixels_gt=P)")
        return cls(frozenset(steps), pixels_gt, marker_dir)

    def check(self, step: int, batch_size: int, height: int, width: int) -> None:
        import torch

        pixels = batch_size * height * width
        if self.pixels_gt is not None and pixels > self.pixels_gt:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (injected by {INJECT_ENV}: {batch_size}x{height}x{width} = {pixels} px "
                f"> {self.pixels_gt})"
            )
        if step in self.steps:
            marker = self.marker_dir / f"injected-oom-step{step}" if self.marker_dir else None
            if marker is not None and marker.exists():
                return
            if marker is not None:
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.touch()
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected by {INJECT_ENV} at step {step})")
