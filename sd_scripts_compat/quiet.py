"""Keep known-harmless library messages off the user's screen.

The screen should show our messages. Two libraries log warnings on every run that say nothing to a
LoRA trainer: bitsandbytes (CPU build, on CPUs with AVX512-BF16) cannot fetch an optional 4-bit GEMM kernel
from a model hub it must not reach anyway (and the ``kernels`` package it asks says so too when offline);
diffusers warns about keeping float32 modules when a VAE without any such modules (the list it prints is
empty) is cast, and diffusers' Chroma model imports a deprecated alias of its own; FSDP2 and torch's profiler on a
sharded run of several processes (below). Each filter matches one
message exactly; anything else those loggers say still shows. Around sampling (diffusers' pipelines: a
scheduler-config deprecation dumped with the whole config, transformers' image-processor notice)
:func:`libraries_quiet` drops the libraries' warnings altogether. ``LORA_AUTOTUNE_VERBOSE=1``
(``autotune run --verbose``) keeps everything.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import TextIO

VERBOSE_ENV = "LORA_AUTOTUNE_VERBOSE"
NOISY_LIBRARIES = ("diffusers", "transformers", "torch", "accelerate", "huggingface_hub")


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")

# logger name -> messages (regular expressions on the formatted message) that are dropped
HARMLESS: dict[str, tuple[str, ...]] = {
    "bitsandbytes.backends.cpu.ops": (r"^Failed to load CPU gemm_4bit_forward from kernels-community",),
    "kernels._internals.hf_hub": (
        r"^Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes' because Hugging Face Hub "
        r"is in offline mode\.$",
    ),
    "diffusers.models.modeling_utils": (r"^There are modules in \w+ that should be kept in float32: \[\]\.",),
}

# Python warnings (message regular expressions) dropped the same way: diffusers' Chroma transformer imports its
# own deprecated FluxPosEmbed alias on every build; FSDP2 (``fsdp``) warns that diffusers' FLUX blocks return
# views, which would lose its backward hook if modified in place: diffusers does not (a sharded run's LoRA is the
# unsharded run's, bit for bit: tests/test_sharding.py)
HARMLESS_WARNINGS: tuple[str, ...] = (r"`FluxPosEmbed` is deprecated",
                                      r"^FSDP2-wrapped module \(FSDP\w+\) returned a view tensor")
# kineto (torch.profiler: one step of a several-process run is profiled) prints its start and stop on stderr
# below this level; 6 is past its last (USDT)
KINETO_QUIET_LEVEL = "6"


class _DropMatching(logging.Filter):
    def __init__(self, patterns: tuple[str, ...]) -> None:
        super().__init__()
        self.patterns = tuple(re.compile(p) for p in patterns)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.search(message) for p in self.patterns)


def our_warnings_as_lines(program: str, also: tuple[str, ...] = ()) -> None:
    """The engine's own warnings (``warnings.warn`` in ``sd_scripts_compat``, and in the package folders ``also``
    names: the tuner's CLI passes its own) as one line each in the style of its errors, ``train_network: warning:
    ...``, instead of Python's file, line and source; others as Python shows them. Set once by the entry point,
    for its process."""
    import sys
    import warnings

    python_shows = warnings.showwarning
    packages = (os.path.dirname(os.path.abspath(__file__)), *also)

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: TextIO | None = None,
             line: str | None = None) -> None:
        if not str(filename).startswith(packages):
            python_shows(message, category, filename, lineno, file, line)
            return
        print(f"{program}: warning: {' '.join(str(message).split())}", file=file or sys.stderr)

    warnings.showwarning = show


def silence_harmless_library_messages() -> None:
    """Install the filters (idempotent); call before the libraries are imported. Nothing when verbose."""
    if verbose():
        return
    import warnings

    for pattern in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET_LEVEL)  # read when the profiler starts
    for name, patterns in HARMLESS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMatching) for f in logger.filters):
            logger.addFilter(_DropMatching(patterns))


@contextlib.contextmanager
def libraries_quiet() -> Iterator[None]:
    """While the block runs, the libraries' Python warnings and log records below ERROR are dropped (ours still
    show); when verbose, nothing changes."""
    import warnings

    if verbose():
        yield
        return
    loggers = [logging.getLogger(name) for name in NOISY_LIBRARIES]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        for library in NOISY_LIBRARIES:
            warnings.filterwarnings("ignore", module=rf"{library}(\.|$)")
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)
