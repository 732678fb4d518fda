"""The known-harmless library messages are dropped, exactly those, and ``--verbose`` brings them back.

bitsandbytes' CPU build asks the ``kernels`` package for an optional 4-bit GEMM kernel from the Hub when the CPU has
AVX512-BF16 (CI's CPU has it, this development machine does not); offline, both libraries log a warning on every
import. The test runs bitsandbytes' own CPU-ops module again with that CPU flag FAKED on, so the real messages come
from the real loggers on any CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

IMPORT_AS_ON_AN_AVX512_BF16_CPU = """
import importlib, logging, sys, warnings
from sd_scripts_compat.quiet import silence_harmless_library_messages
silence_harmless_library_messages()
import bitsandbytes.functional as functional
functional.has_avx512bf16 = lambda: True  # FAKE: the CPU flag
import bitsandbytes.backends.cpu.ops as ops
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # torch: the reload registers the same kernels again
    importlib.reload(ops)
logging.getLogger("kernels._internals.hf_hub").warning("another kernels message still shows")
"""


def _import_bitsandbytes(verbose: bool) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LORA_AUTOTUNE_VERBOSE": "1" if verbose else "0"}
    done = subprocess.run([sys.executable, "-c", IMPORT_AS_ON_AN_AVX512_BF16_CPU], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_bitsandbytes_kernel_hub_messages_are_dropped_and_only_they():
    assert _import_bitsandbytes(verbose=False).strip() == "another kernels message still shows"


@pytest.mark.long
def test_verbose_shows_the_bitsandbytes_kernel_hub_messages():
    said = _import_bitsandbytes(verbose=True)
    assert "Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes'" in said
    assert "Failed to load CPU gemm_4bit_forward" in said
