"""The stall limit per phase (``autotune.recovery.stall``): what the engine says it does sets how long it may be
silent."""

from __future__ import annotations

import pytest

from autotune.recovery.stall import SLOW_DISK_BYTES_PER_S, TRAINING_FLOOR_S, describe, stall_limit

BASE = 600.0


@pytest.mark.parametrize("phase, progress, limit", [
    (None, None, BASE),  # python and torch starting: nothing said yet
    ({"phase": "loading", "bytes": 24 * 10**9}, None, BASE + 24 * 10**9 / SLOW_DISK_BYTES_PER_S),  # ~24 min more
    ({"phase": "loading", "bytes": 0}, None, BASE),  # a built-in model
    ({"phase": "caching", "done": 3, "total": 40}, None, BASE),  # per image: the clock restarts with each
    ({"phase": "training"}, None, BASE),  # no step yet: the first one may warm up for long
    ({"phase": "training"}, {"it_per_s": 2.0}, TRAINING_FLOOR_S),  # quick steps: a minute
    ({"phase": "training"}, {"it_per_s": 0.01}, 1000.0),  # 100 s steps: ten of them
    ({"phase": "saving"}, {"it_per_s": 2.0}, BASE),
])
def test_each_phase_has_its_limit(phase, progress, limit):
    assert stall_limit(phase, progress, BASE) == pytest.approx(limit)


def test_a_low_base_lowers_the_training_floor_too():
    assert stall_limit({"phase": "training"}, {"it_per_s": 50.0}, 1.0) == 1.0


def test_a_24_gb_file_loading_for_20_minutes_is_not_stalled():
    assert stall_limit({"phase": "loading", "bytes": 24 * 10**9}, None, BASE) > 20 * 60


@pytest.mark.parametrize("phase, said", [
    ({"phase": "loading", "bytes": 3 * 2**30}, "loading (3.0 GiB)"),
    ({"phase": "caching", "done": 12, "total": 40}, "caching (12 of 40)"),
    ({"phase": "training", "done": 0}, "training"),
    (None, None),
])
def test_the_stall_message_names_the_phase(phase, said):
    assert describe(phase) == said
