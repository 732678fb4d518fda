"""Atomic writes: whole files or nothing, with the permissions the umask gives (not mkstemp's 0600)."""

from __future__ import annotations

import os
import stat

import pytest
import torch
from safetensors.torch import save_file

from sd_scripts_compat.facts.atomic import atomic_folder, atomic_path, write_json_atomic, write_text_atomic


@pytest.fixture
def umask():
    def set_mask(mask: int) -> None:
        os.umask(mask)

    before = os.umask(0o022)
    yield set_mask
    os.umask(before)


@pytest.mark.parametrize(("mask", "file_mode", "dir_mode"), [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)])
def test_files_and_folders_get_the_umask_permissions(tmp_path, umask, mask, file_mode, dir_mode):
    umask(mask)
    write_text_atomic(tmp_path / "a.toml", "x = 1\n")
    write_json_atomic(tmp_path / "events" / "done.json", {"steps": 3})
    with atomic_folder(tmp_path / "lora-state") as folder:
        write_text_atomic(folder / "train_state.json", "{}")
        save_file({"w": torch.zeros(2)}, str(folder / "tensors.safetensors"))  # safetensors recreates as 0600
    with atomic_path(tmp_path / "lora.safetensors") as tmp:
        save_file({"w": torch.zeros(2)}, str(tmp))
    assert stat.S_IMODE((tmp_path / "a.toml").stat().st_mode) == file_mode
    assert stat.S_IMODE((tmp_path / "events" / "done.json").stat().st_mode) == file_mode
    assert stat.S_IMODE((tmp_path / "lora-state").stat().st_mode) == dir_mode
    assert stat.S_IMODE((tmp_path / "lora-state" / "tensors.safetensors").stat().st_mode) == file_mode
    assert stat.S_IMODE((tmp_path / "lora.safetensors").stat().st_mode) == file_mode
    assert (tmp_path / "a.toml").read_text() == "x = 1\n"


@pytest.mark.parametrize(("mask", "file_mode"), [(0o022, 0o644), (0o077, 0o600)])
def test_safetensors_files_get_the_umask_permissions_too(tmp_path, umask, mask, file_mode):
    """safetensors' save_file replaces the file it is given with a 0600 one: atomic_path sets the mode again,
    and a training state's tensor file (written by a real Checkpointer path) follows the umask."""
    import torch
    from safetensors.torch import save_file

    from sd_scripts_compat.training.train_state import TrainCounters, save_train_state

    umask(mask)
    with atomic_path(tmp_path / "cache.safetensors") as tmp:
        save_file({"a": torch.zeros(3)}, str(tmp))
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([weight])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    folder = save_train_state(tmp_path / "lora-state", lora_state={"w": weight.detach()}, optimizer=optimizer,
                              lr_scheduler=scheduler, counters=TrainCounters(), settings={})
    for path in (tmp_path / "cache.safetensors", folder / "tensors.safetensors", folder / "train_state.json"):
        assert stat.S_IMODE(path.stat().st_mode) == file_mode, path


def test_a_failed_write_leaves_the_old_file_and_folder_and_no_temp(tmp_path):
    write_text_atomic(tmp_path / "c.toml", "old = 1\n")
    with atomic_folder(tmp_path / "s-state") as folder:
        (folder / "f").write_text("old")
    with pytest.raises(RuntimeError), atomic_folder(tmp_path / "s-state") as folder:
        (folder / "f").write_text("new")
        raise RuntimeError("disk full")
    with pytest.raises(RuntimeError), atomic_path(tmp_path / "c.toml") as tmp:
        tmp.write_text("new = 1\n")
        raise RuntimeError("killed mid-write")
    assert (tmp_path / "c.toml").read_text() == "old = 1\n"
    assert (tmp_path / "s-state" / "f").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml", "s-state"]
