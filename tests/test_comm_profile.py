"""The share of a several-process step spent in collectives (issue 53, item 3: ``report`` shows it): one step
profiled by ``training.comm_profile``, its gloo (or NCCL) time summed, set against the run's seconds per step.
The two-process run that reports it end to end is ``tests/test_sharding.py``; here the profile on a real gloo
group of one process, and the report of a done.json as two CUDA processes write it (FAKE: no GPU here)."""

from __future__ import annotations

import dataclasses

import pytest

from autotune.report.analysis import build_report
from autotune.report.render import render_text
from sd_scripts_compat.training.comm_profile import CommProfile
from tests.test_report import _cuda_run


@pytest.fixture
def gloo_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


def test_the_step_after_the_warm_up_is_profiled_once_and_its_gloo_time_summed(gloo_group):
    import torch
    import torch.distributed as dist

    profile = CommProfile(world=2, device_type="cpu", after=2)
    for step in range(5, 9):  # a run resumed at step 5: steps 5 and 6 warm up, step 7 is profiled
        profile.begin(step)
        dist.all_reduce(torch.ones(1 << 16))
        profile.end()
        assert (profile.seconds is None) == (step < 7)
    summary = profile.summary()
    assert summary is not None and summary["step"] == 7 and summary["method"] == "gloo_threads"
    assert 0 < summary["seconds"] < 60


def test_one_process_profiles_nothing():
    profile = CommProfile(world=1, device_type="cpu", after=0)
    profile.begin(0)
    profile.end()
    assert profile.summary() is None and profile.seconds is None


def test_the_report_gives_each_process_its_collectives_and_their_share_of_a_step_fake_cuda(tmp_path):
    run = _cuda_run(tmp_path, used_gib=10.0)
    done = {**run.done, "process_peaks": [10240.0, 10100.0],
            "communication": [{"schema": 1, "step": 5, "seconds": 0.18, "method": "nccl_kernels"}, None]}
    report = build_report(dataclasses.replace(run, done=done))
    comm = report["communication"]
    assert comm["step_seconds"] == 0.9 and comm["per_process"][0] == {"seconds": 0.18, "share": pytest.approx(0.2)}
    assert comm["per_process"][1] is None
    text = " ".join(render_text(report).split())  # the text is wrapped to the terminal
    assert "communication (one profiled step, NCCL's kernels, overlapping the compute): 0: 0.180 s (20% of a " \
           "step), 1: not profiled" in text


@pytest.mark.parametrize("given", [None, [], [None, None], "0.2", [{"seconds": -1.0, "method": "gloo_threads"}]])
def test_a_report_without_believable_figures_says_nothing_of_communication(tmp_path, given):
    run = _cuda_run(tmp_path, used_gib=10.0)
    report = build_report(dataclasses.replace(run, done={**run.done, "communication": given}))
    rows = (report["communication"] or {}).get("per_process") or []
    assert all(row is None for row in rows)
    assert "not profiled" in render_text(report) or "communication" not in render_text(report)
