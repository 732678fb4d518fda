"""Every test gets its own measurement store (``AUTOTUNE_CACHE_DIR``): a run or bench in one test must not teach
the plans of another, nor write into the user's real cache folder.

Under pytest-xdist (``-n 2`` on two cores) each worker and the engines it starts use one thread: a second thread
per worker only oversubscribes the cores (OpenMP's spinning threads then slow every test down).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"  # before any test module imports torch; subprocesses inherit it


@pytest.fixture(autouse=True)
def _own_measurement_store(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path_factory.mktemp("autotune-cache")
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(folder))
    return folder
