"""Every test gets its own measurement store (``AUTOTUNE_CACHE_DIR``): a run or bench in one test must not teach
the plans of another, nor write into the user's real cache folder."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _own_measurement_store(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path_factory.mktemp("autotune-cache")
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(folder))
    return folder
