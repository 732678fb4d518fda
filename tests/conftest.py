"""Every test gets its own measurement store (``AUTOTUNE_CACHE_DIR``): a run or bench in one test must not teach
the plans of another, nor write into the user's real cache folder (subprocess environments built at import
time get a session-wide one).

Under pytest-xdist (``-n 2`` on two cores) each worker and the engines it starts use one thread: a second thread
per worker only oversubscribes the cores (OpenMP's spinning threads then slow every test down).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"  # before any test module imports torch; subprocesses inherit it
# a store for the whole session too, set before the test modules build their subprocess environments from
# os.environ (the per-test fixture below comes later): no test may write into the user's real cache folder
os.environ["AUTOTUNE_CACHE_DIR"] = tempfile.mkdtemp(prefix="autotune-cache-")
atexit.register(shutil.rmtree, os.environ["AUTOTUNE_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(autouse=True)
def _own_measurement_store(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path_factory.mktemp("autotune-cache")
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(folder))
    return folder


# Tests that mostly wait (a model held loading for 3 minutes, a frozen step held for one) leave their core idle:
# started first, the other worker fills the wait; started last, the whole run waits for them at its end.
WAITING_TESTS = ("tests/test_stalls.py::",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: not item.nodeid.startswith(WAITING_TESTS))  # stable: the rest keep their order
