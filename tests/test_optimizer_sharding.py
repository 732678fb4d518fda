"""``shard_optimizer_state`` (issue 53, item 1: "LoRA parameters and their optimizer state sharded or replicated"):
each process keeps the optimizer state of its share of the LoRA's parameters (ZeRO stage 1, torch's
ZeroRedundancyOptimizer). Two CPU processes on gloo (accelerate's launcher) training tiny-flux: the LoRA of the run
whose state is whole on each, half the state on each card, and a state saved by either run resumed by the other
to the same LoRA. No GPU here."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import torch

from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.network.lora_file import read_lora_file
from sd_scripts_compat.training.optimizer_sharding import check_state_sharding
from tests.test_sharding import ENV, MODELS, ROOT, _command, _config, _launch

SCRIPT, FLUX = MODELS["tiny-flux"]


def _same(one_path, two_path) -> None:
    one, two = read_lora_file(one_path)[0], read_lora_file(two_path)[0]
    assert list(one) == list(two)
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-4, atol=1e-6)


@pytest.mark.long
@pytest.mark.parametrize("optimizer", ["AdamW", pytest.param("AdamW8bit", marks=pytest.mark.slow)])
def test_each_process_keeps_the_state_of_its_share_and_the_lora_is_the_whole_state_runs(tmp_path, optimizer):
    """Same seed, same steps: the LoRA equals the run whose every process keeps the whole state; the main process
    keeps the state of about half the LoRA's elements, and the emulated card's peak drops by about half the
    state (AdamW: two fp32 moments per element; measured at rank 64)."""
    env = {**ENV, "SD_COMPAT_EMULATED_CARD_MIB": "100000"}
    peaks = {}
    for name, extra in (("whole", {}), ("sharded", {"shard_optimizer_state": True})):
        config = _config(tmp_path, name, FLUX, optimizer_type=optimizer, network_dim=64, network_alpha=64, **extra)
        events = tmp_path / f"{name}-events"
        done = subprocess.run(_command(SCRIPT, config, "--autotune_events_dir", str(events)), capture_output=True,
                              text=True, cwd=ROOT, env=env, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        assert not done.stderr.strip(), done.stderr[-3000:]
        peaks[name] = json.loads((events / "done.json").read_text(encoding="utf-8"))["memory"][
            "emulated_card_peak_mib"]
        if extra:
            said = re.search(r"split across 2 processes by parameter; the main process keeps that of ([\d,]+) of "
                             r"the LoRA's ([\d,]+) elements", done.stdout)
            assert said, done.stdout[-2000:]
            owned, every = (int(x.replace(",", "")) for x in said.groups())
    _same(tmp_path / "whole" / "lora.safetensors", tmp_path / "sharded" / "lora.safetensors")
    assert 0.4 * every <= owned <= 0.6 * every
    if optimizer == "AdamW":  # two fp32 moments of the elements the main process does not own leave its card
        saved = (every - owned) * 2 * 4 / 2**20
        assert peaks["whole"] - peaks["sharded"] == pytest.approx(saved, rel=0.1)


@pytest.mark.slow
@pytest.mark.parametrize(("first", "then"), [({}, {"shard_optimizer_state": True}),
                                             ({"shard_optimizer_state": True}, {})])
def test_a_state_saved_by_either_run_resumes_in_the_other_to_the_straight_runs_lora(tmp_path, first, then):
    """The step-2 state of a 4-step run (gathered to the main process when sharded, one folder either way) resumed
    with the state split the other way: the LoRA of the straight run, which did not stop."""
    first_run = _launch(SCRIPT, _config(tmp_path, "first", FLUX, save_every_n_steps=2, save_state=True, **first))
    assert first_run.returncode == 0, first_run.stderr[-3000:]
    state = tmp_path / "first" / "lora-step00000002-state"
    assert state.is_dir()
    resumed = _launch(SCRIPT, _config(tmp_path, "resumed", FLUX, **then), "--resume", str(state))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at step 2" in resumed.stdout
    _same(tmp_path / "first" / "lora.safetensors", tmp_path / "resumed" / "lora.safetensors")


@pytest.mark.long
def test_prodigy_with_its_state_split_across_two_processes_is_one_line(tmp_path):
    """Each process says the same one line before any model is loaded, no traceback, nothing in the output
    folder (split, Prodigy would estimate d per process: the LoRA differs, measured in the closing note)."""
    done = _launch(SCRIPT, _config(tmp_path, "prodigy", FLUX, optimizer_type="Prodigy", learning_rate=1.0,
                                   shard_optimizer_state=True))
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.startswith("flux_train_network: error:")]
    assert len(lines) == 2 and lines[0] == lines[1], done.stderr[-3000:]
    assert "shard_optimizer_state: Prodigy's step sums over all of the LoRA's parameters" in lines[0]
    assert not re.search(r"\[rank\d\]: Traceback", done.stderr) and not (tmp_path / "prodigy").exists()


def test_one_process_with_a_sharded_state_is_one_line():
    with pytest.raises(UserError, match="shard_optimizer_state: it splits the optimizer's state across several"):
        check_state_sharding(True, 1, "AdamW")
    check_state_sharding(True, 2, "AdamW8bit")
    check_state_sharding(False, 1, "Prodigy")


# ---- planned: the memory model's share, the planner's choice, the OOM ladder's rung ------------------------------


def test_the_memory_models_share_is_zero_redundancy_optimizers_partition_of_flux_devs_lora():
    """ZeroRedundancyOptimizer itself (on torch's fake process group of 4) partitions tensors of FLUX.1 dev's
    LoRA sizes at rank 32 (the memory model's list): the most loaded process keeps the share ``state_share``
    computes, within 1 % of a quarter."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from autotune.estimate.dit_memory import dit_family_calibration, lora_sizes
    from autotune.estimate.memory_model import state_share

    sizes = lora_sizes(dit_family_calibration("flux-dev")["architecture"], 32)
    params = [torch.nn.Parameter(torch.empty(numel, device="meta")) for numel, count in sizes for _ in range(count)]
    dist.init_process_group("fake", rank=0, world_size=4, store=dist.HashStore())
    try:
        zero = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.SGD, lr=0.1)
        parts = zero._partition_parameters()  # its own partition (private: no public accessor)
        loads = [sum(p.numel() for group in part for p in group["params"]) for part in parts]
    finally:
        dist.destroy_process_group()
    assert max(loads) / sum(loads) == pytest.approx(state_share(sizes, 4), rel=1e-6)
    assert state_share(sizes, 4) == pytest.approx(0.25, rel=0.01) and state_share(sizes, 1) == 1.0


def _plan(model: str, card: str, count: int, **prefs):
    from autotune.hardware.gpu_catalog import lookup_gpu
    from autotune.planning.planner import PlanRequest, gpu_from_spec, nominal_dataset, plan_training
    from autotune.planning.request import Preferences

    gpus = tuple(gpu_from_spec(lookup_gpu(card)) for _ in range(count))
    return plan_training(PlanRequest(dataset_dir=None, model=model, dataset=nominal_dataset(), gpus=gpus,
                                     cpu_physical_cores=16, preferences=Preferences(resolution=1024, **prefs)))


def test_the_planner_splits_the_state_where_that_fits_a_larger_micro_batch():
    """SDXL with AdamW at rank 64 on 2 x RTX 4060 8 GB, sharded: kept whole on each card, AdamW's two fp32 moments
    (1.27 GiB) leave room for micro-batch 1; split across the two cards, micro-batch 2 fits and is faster. The
    config carries the key and the engine reads it."""
    plan = _plan("builtin:sdxl", "RTX 4060", 2, optimizer="AdamW", rank=64)
    s = plan.settings
    assert s.shard_optimizer_state and s.optimizer_type == "AdamW" and s.train_batch_size == 2 and plan.fits
    reason = next(c for c in plan.choices if c.key == "shard_optimizer_state").reason
    assert reason.startswith("the LoRA's optimizer state split across the 2 cards (0.63 GiB per card;")
    assert "kept whole on each (1.27 GiB per card) it is slower (6.9 GiB per card, micro-batch 1," in reason
    assert plan.kohya_values()["shard_optimizer_state"] is True
    components = dict(plan.prediction.components)
    assert components["optimizer_state"] == pytest.approx(1.27 * 2**30 / 2, rel=0.01)


def test_prodigys_state_stays_whole_its_step_sums_over_every_parameter():
    """Prodigy estimates d from sums over all of the LoRA's parameters: split, each process would estimate from
    its own share (measured by hand: tiny-flux, 8 steps, 2 processes, a LoRA 0.196 off in weights of at most
    0.215). FLUX.1 dev with Prodigy at rank 64 on 4 x RTX 4060 Ti 16 GB keeps it whole and says why; the engine
    refuses the split in one line."""
    plan = _plan("builtin:flux-dev", "RTX 4060 Ti 16GB", 4, optimizer="Prodigy", rank=64)
    assert not plan.settings.shard_optimizer_state and "shard_optimizer_state" not in plan.kohya_values()
    row = next(c for c in plan.choices if c.key == "shard_optimizer_state")
    assert row.value is False and row.reason.startswith(
        "the LoRA's optimizer state kept whole on each card: Prodigy's step sums over all of the LoRA's parameters")
    with pytest.raises(UserError, match="shard_optimizer_state: Prodigy's step sums over all of the LoRA's "
                                        "parameters, so each process would step its share by its own sums"):
        check_state_sharding(True, 2, "Prodigy")


def test_the_planner_keeps_the_state_whole_where_splitting_it_gains_nothing():
    plan = _plan("builtin:flux-dev", "RTX 4060 Ti 16GB", 4)
    assert not plan.settings.shard_optimizer_state and "shard_optimizer_state" not in plan.kohya_values()
    row = next(c for c in plan.choices if c.key == "shard_optimizer_state")
    assert row.value is False and row.reason.startswith(
        "the LoRA's optimizer state kept whole on each card (0.29 GiB per card): split across them (0.07 GiB per "
        "card) the plan gains nothing")
    assert all(c.key != "shard_optimizer_state" for c in _plan("builtin:flux-dev", "RTX 4090", 1).choices)


def test_splitting_the_state_costs_one_pass_of_the_lora_over_the_link_per_step():
    from dataclasses import replace

    from autotune.estimate.dit_memory import dit_family_calibration
    from autotune.estimate.sharded_weights import state_sync_bytes
    from autotune.hardware.gpu_catalog import lookup_gpu
    from autotune.planning.search import estimate_for_settings
    from sd_scripts_compat.facts.families import get_family
    from sd_scripts_compat.facts.settings import TrainSettings

    family, card = get_family("flux-dev"), lookup_gpu("RTX 4060 Ti 16GB")
    s = TrainSettings(resolution=(1024, 1024), gradient_checkpointing=True, optimizer_type="AdamW", network_dim=32,
                      mixed_precision="bf16", cache_latents=True, cache_text_encoder_outputs=True,
                      network_train_unet_only=True, fsdp="full_shard")
    (whole_memory, whole_speed), (split_memory, split_speed) = (
        estimate_for_settings(family, replace(s, shard_optimizer_state=on), 16, devices=4) for on in (False, True))
    state = dict(whole_memory.components)["optimizer_state"]
    assert dict(split_memory.components)["optimizer_state"] == pytest.approx(state / 4, rel=0.01)
    lora = dict(split_memory.components)["lora_params"]
    added = split_speed(card).seconds_per_step - whole_speed(card).seconds_per_step
    efficiency = dit_family_calibration("flux-dev")["speed"]["link_efficiency"]
    assert added == pytest.approx(lora * 3 / 4 / (card.pcie_gbps * 1e9 * efficiency), rel=1e-6) and added > 0
    assert state_sync_bytes(4, 2) == 2.0


def test_the_oom_ladder_splits_the_state_of_a_run_of_several_processes_first():
    """Nothing trained changes and the state resumes either way: the mildest rung for a run of several processes
    of our engine; one process has no such rung, nor has Prodigy (its sums over every parameter)."""
    from dataclasses import replace

    from autotune.recovery.ladder import Decision, LadderLimits, memory_predictor, next_settings
    from sd_scripts_compat.facts.families import get_family
    from sd_scripts_compat.facts.settings import TrainSettings

    family = get_family("sdxl")
    failed = TrainSettings(train_batch_size=4, resolution=(1024, 1024), gradient_checkpointing=True,
                           optimizer_type="AdamW", network_dim=64, network_train_unet_only=True,
                           mixed_precision="bf16", cache_latents=True, cache_text_encoder_outputs=True)
    predict = memory_predictor(family, cuda=True, processes=2)
    need = predict(failed)
    limits = replace(LadderLimits.for_family(family, int(need) - 200, fp8_supported=True, te_cache_allowed=True),
                     shard_processes=2)
    step = next_settings(failed, limits, predict, measured_mib=need)
    assert isinstance(step, Decision) and step.changes == {"shard_optimizer_state": (False, True)}
    assert step.resume_compatible and "optimizer state split" in step.reasons[0]
    alone = next_settings(failed, replace(limits, shard_processes=1), predict, measured_mib=need)
    assert isinstance(alone, Decision) and "shard_optimizer_state" not in alone.changes
    prodigy = next_settings(replace(failed, optimizer_type="Prodigy"), limits, predict, measured_mib=need)
    assert isinstance(prodigy, Decision) and "shard_optimizer_state" not in prodigy.changes  # its sums: whole


@pytest.mark.slow
def test_a_stopped_run_with_the_state_split_saves_it_whole_at_the_step_its_processes_agree_on(tmp_path):
    """SIGTERM to the launcher (as the watchdog forwards it) while both processes train, timed state saves due at
    every step (rank 0's clock, told to both): every process stops at one step, the parts are gathered, and the one
    state folder holds every LoRA tensor's state; a run with the state split resumes from it to its end. The run
    is long (2,000 steps) so that the signal, sent at its first progress report, comes long before its end."""
    import os
    import signal
    import time

    from sd_scripts_compat.training.train_state import load_train_state

    events = tmp_path / "events"
    config = _config(tmp_path, "stopped", FLUX, shard_optimizer_state=True, max_train_steps=2000)
    child = subprocess.Popen(_command(SCRIPT, config, "--autotune_events_dir", str(events),
                                      "--save_state_every_seconds", "0.000001"),
                             cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not (events / "progress.json").exists():
        assert child.poll() is None, child.communicate()[1][-3000:]
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGTERM)
    _, stderr = child.communicate(timeout=600)
    said = re.findall(r"SIGTERM: stopped at step (\d+); state saved to (\S+)", stderr)
    assert len(said) == 1, stderr[-3000:]  # the main process's line; every process stopped at the same step
    step, folder = int(said[0][0]), tmp_path / "stopped" / "lora-state"
    state = load_train_state(folder)
    assert state.counters.global_step == step < 2000
    assert len(state.optimizer_state["state"]) == len(state.lora_state) - _alphas(state.lora_state)
    resumed = _launch(SCRIPT, _config(tmp_path, "resumed", FLUX, shard_optimizer_state=True,
                                      max_train_steps=step + 2), "--resume", str(folder))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {step}" in resumed.stdout
    assert read_lora_file(tmp_path / "resumed" / "lora.safetensors")[1]["ss_steps"] == str(step + 2)


def _alphas(lora_state: dict) -> int:
    return sum(1 for key in lora_state if key.endswith(".alpha"))


@pytest.mark.parametrize(("split_speed", "split_fallbacks", "chosen", "said"), [
    (1.0, (), "whole", "split across them (0.50 GiB per card) the plan gains nothing"),
    (0.9, (), "whole", "split across them (0.50 GiB per card) the plan is slower"),
    (1.0, ("fp8 base weights",), "whole", "the plan gains nothing"),
    (0.9, (), "split", "kept whole on each (1.00 GiB per card) the plan needs rank 16 to fit, which lowers what "
                       "trains"),
])
def test_the_state_choice_says_what_each_way_costs(split_speed, split_fallbacks, chosen, said):
    """``choose_state`` on made-up searches: a split that is not ahead stays whole and says whether it is slower or
    merely gains nothing (a split that gives up more to fit is not ahead either); a 10 % slower split wins where
    the whole state lowered the rank to fit, and the row names what that cost."""
    from dataclasses import replace

    from autotune.planning.search import Scored, SearchResult
    from autotune.planning.sharding import ShardingChoice, choose_state
    from sd_scripts_compat.facts.settings import TrainSettings

    start = TrainSettings(network_dim=32)

    def way(state_gib: float, speed: float, fallbacks: tuple[str, ...], settings: TrainSettings) -> ShardingChoice:
        scored = Scored(settings=settings, required=1, peak=2**30, components=(("optimizer_state", int(state_gib
                        * 2**30)),), it_per_s=speed, samples_per_s=speed)
        return ShardingChoice(SearchResult(chosen=scored, smallest=scored, fallbacks=fallbacks), "why")

    whole_fallbacks = ("rank 16",) if chosen == "split" else ()
    whole = way(1.0, 1.0, whole_fallbacks, start)
    split = way(0.5, split_speed, split_fallbacks, replace(start, shard_optimizer_state=True))
    if chosen == "split":  # the whole state lowered the rank to fit
        whole = way(1.0, 1.0, whole_fallbacks, replace(start, network_dim=16))
    picked, reason = choose_state(start, 2, whole, split)
    assert (picked is split) == (chosen == "split") and said in reason
