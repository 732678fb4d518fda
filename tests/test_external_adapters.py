"""What the adapters of the user's sd-scripts and musubi-tuner share (``autotune/recovery/external.py``): the
ledger of true steps both keep, read back by ``--resume``, and the rate a save interval is reckoned at."""

from __future__ import annotations

import json
import os
from pathlib import Path

from autotune.recovery.external import StateLedger, save_every_n_steps, save_rate


def _folder(root: Path, name: str, mtime_s: int) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "train_state.json").write_text(json.dumps({"current_step": 999}))
    os.utime(folder / "train_state.json", (mtime_s, mtime_s))
    os.utime(folder, (mtime_s, mtime_s))
    return folder


def _mtime(folder: Path) -> int | None:
    return (folder / "train_state.json").stat().st_mtime_ns if folder.name.endswith("-state") else None


def test_a_musubi_ledger_written_before_the_shared_one_resumes_from_its_newest_whole_state(tmp_path):
    states = tmp_path / "run"
    states.mkdir()
    _folder(states, "lora-from00000000-step00000004-state", 1_000)
    _folder(states, "lora-from00000004-step00000004-state", 2_000)
    path = tmp_path / "ledger.json"
    path.write_text(json.dumps({"target_steps": 12, "whole": {"lora-from00000000-step00000004-state": 4,
                                                             "lora-from00000004-step00000004-state": 8,
                                                             "lora-from00000008-step00000004-state": 12}}))
    ledger = StateLedger.load(path)
    assert ledger.target_steps == 12
    # the step-12 folder is listed but gone (trimmed): the newest present whole one is step 8
    assert ledger.newest(states, lambda folder: folder.stat().st_mtime_ns if folder.is_dir() else None) == (
        states / "lora-from00000004-step00000004-state", 8)
    ledger.save()
    assert "whole" not in json.loads(path.read_text()) and ledger.states == StateLedger.load(path).states


def test_a_folder_rewritten_unseen_is_not_resumed_and_one_never_seen_counts_at_its_own_step(tmp_path):
    states = tmp_path / "out"
    states.mkdir()
    seen = _folder(states, "a-state", 1_000)
    rewritten = _folder(states, "b-state", 1_000)
    ledger = StateLedger(tmp_path / "ledger.json", 20, {
        "a-state": {"step": 6, "mtime_ns": _mtime(seen), "confirmed": True},
        "b-state": {"step": 9, "mtime_ns": _mtime(rewritten), "confirmed": True}})
    os.utime(rewritten / "train_state.json", (3_000, 3_000))  # written again while nobody watched: maybe half
    assert ledger.newest(states, _mtime) == (seen, 6)
    _folder(states, "user-state", 500)  # a state the user brought: its own train_state.json says the step
    assert ledger.newest(states, _mtime, lambda folder: 7 if folder.name == "user-state" else None) == (
        states / "user-state", 7)
    ledger.states["a-state"]["confirmed"] = False  # a killed attempt's newest folder: not whole yet
    assert ledger.newest(states, _mtime) is None


def test_the_save_interval_comes_from_the_measured_rate_then_half_the_plan():
    assert save_rate(3.0, 10.0) == (3.0, "measured in the last attempt")
    assert save_rate(None, 10.0) == (5.0, "half the plan's prediction, to be safe")
    assert save_rate(None, None)[1] == "no measurement yet"
    assert save_every_n_steps(60, save_rate(None, 10.0)[0], target_steps=1000) == 300
