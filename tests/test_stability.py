"""Unstable training: the engine's detection (guard, rules, NaN injection), the stability ladder, and the
watchdog's rollback, on real tensors, a real fused AdamW, real engine runs of builtin:tiny-sd15 (32 px:
at 64 px the tiny VAE of today still downsamples by 2 only, ~3 s a step on this CPU) and the fake engine.
Watchdog runs with the real engine are in test_run_e2e.py.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import toml
import torch
from fixtures.fake_engine import fake_memory_mib, fake_settings
from safetensors import safe_open

from autotune.layout import DECISIONS_LOG
from autotune.recovery.engine import CompatEngine
from autotune.recovery.ladder import LadderLimits
from autotune.recovery.stability import (
    RUNGS,
    StabilityDecision,
    StabilityLimits,
    Unstable,
    longer_warmup,
    next_stable_settings,
)
from autotune.recovery.watchdog import Job, supervise
from sd_scripts_compat.facts.contract import DIVERGED_EXIT_CODE, EVENT_KINDS, read_event
from sd_scripts_compat.facts.settings import TrainSettings
from sd_scripts_compat.training.faults import NAN_ENV, NanInjector
from sd_scripts_compat.training.stability import (
    BASELINE_KEY,
    BASELINE_STEPS,
    DIVERGENCE_FACTOR,
    SCALED_NONFINITE_STREAK,
    WINDOW_STEPS,
    Diverged,
    DivergenceRule,
    StabilityGuard,
)

ROOT = Path(__file__).resolve().parents[1]
FAKE = Path(__file__).parent / "fixtures" / "fake_engine.py"


# ---------------------------------------------------------------- the stability ladder (pure)

FP32 = TrainSettings(learning_rate=1e-4, unet_lr=2e-4, text_encoder_lr=(5e-5,), lr_scheduler="constant")


def test_ladder_walks_precision_rate_clipping_rate_then_gives_up_in_one_message():
    fp16 = TrainSettings(mixed_precision="fp16", full_fp16=True, learning_rate=1e-4, max_grad_norm=0.0)
    used: list[str] = []
    settings = fp16
    steps = []
    for _ in range(len(RUNGS)):
        decision = next_stable_settings(settings, StabilityLimits(bf16_supported=True), used=used, diverged_step=30,
                                        max_train_steps=1000)
        assert isinstance(decision, StabilityDecision) and decision.resume_compatible
        steps.append((decision.rung, decision.changes))
        used.append(decision.rung)
        settings = decision.settings
    assert [rung for rung, _ in steps] == list(RUNGS)
    assert steps[0][1] == {"mixed_precision": ("fp16", "bf16"), "full_fp16": (True, False)}
    assert steps[1][1]["learning_rate"] == (1e-4, 5e-5)
    assert steps[1][1]["lr_warmup_steps"] == (0, 60) and steps[1][1]["lr_scheduler"] == ("constant",
                                                                                          "constant_with_warmup")
    assert steps[2][1] == {"max_grad_norm": (0.0, 1.0)}
    assert steps[3][1]["learning_rate"] == (5e-5, 1.25e-5)
    final = next_stable_settings(settings, StabilityLimits(), used=used, last_reason="the loss is nan at step 31")
    assert isinstance(final, Unstable)
    message = final.message()
    assert "keeps diverging (the loss is nan at step 31)" in message and "1.25e-05" in message
    assert all(rung in message for rung in RUNGS) and "\n" not in message


def test_ladder_without_bf16_turns_full_fp16_off_and_skips_what_changes_nothing():
    fp16 = TrainSettings(mixed_precision="fp16", full_fp16=True)
    decision = next_stable_settings(fp16, StabilityLimits(bf16_supported=False))
    assert isinstance(decision, StabilityDecision)
    assert decision.changes == {"full_fp16": (True, False)} and "loss scale" in decision.reason
    # fp32, clipping already on (kohya's default): learning rate, then learning rate again, then nothing
    first = next_stable_settings(FP32, StabilityLimits(), diverged_step=10, max_train_steps=100)
    assert isinstance(first, StabilityDecision) and first.rung == "learning rate"
    assert first.settings.unet_lr == 1e-4 and first.settings.text_encoder_lr == (2.5e-5,)
    again = next_stable_settings(first.settings, StabilityLimits(), used=["learning rate"], diverged_step=10,
                                 max_train_steps=100)
    assert isinstance(again, StabilityDecision) and again.rung == "learning rate again"
    assert isinstance(next_stable_settings(again.settings, StabilityLimits(), used=["learning rate",
                                                                                   "learning rate again"]), Unstable)
    assert isinstance(next_stable_settings(FP32, StabilityLimits(max_tries=1), used=["precision"]), Unstable)
    assert isinstance(next_stable_settings(TrainSettings(lr_scheduler="adafactor"), StabilityLimits()), Unstable)


def test_longer_warmup_reaches_past_the_divergence_within_half_the_run():
    assert longer_warmup(TrainSettings(lr_warmup_steps=0), 17, 60) == 30  # 2 x 17 = 34, capped at half of 60
    assert longer_warmup(TrainSettings(lr_warmup_steps=0), 5, 100) == 10
    assert longer_warmup(TrainSettings(lr_warmup_steps=40), 5, 1000) == 80  # twice the old warm-up
    assert longer_warmup(TrainSettings(lr_warmup_steps=0.1), 5, 1000) == 200  # a ratio counts as its steps
    assert longer_warmup(TrainSettings(lr_warmup_steps=600), 900, 1000) == 600  # never shorter
    decision = next_stable_settings(replace_lr(FP32, lr_warmup_steps=0.1, lr_scheduler="cosine"), StabilityLimits(),
                                    diverged_step=5, max_train_steps=1000)
    assert isinstance(decision, StabilityDecision)
    assert decision.settings.lr_warmup_steps == 200 and decision.settings.lr_scheduler == "cosine"


def replace_lr(settings: TrainSettings, **changes) -> TrainSettings:
    from dataclasses import replace

    return replace(settings, **changes)


# ---------------------------------------------------------------- the divergence rule (host side)

def feed(rule: DivergenceRule, losses) -> tuple[int, tuple[str, str]] | None:
    for step, loss in enumerate(losses):
        trip = rule.judge(step, float(loss), 1.0)
        if trip is not None:
            return step, trip
    return None


def test_a_noisy_healthy_loss_never_trips_and_a_sustained_rise_trips_at_its_seventeenth_step():
    rng = np.random.default_rng(0)
    healthy = 0.1 * np.exp(rng.normal(0.0, 1.0, 20_000))  # heavy-tailed per-step diffusion loss, sigma 1 in log
    assert feed(DivergenceRule(scaled=False, baseline=None), healthy) is None
    onset = 100
    step_rise = np.concatenate([np.full(onset, 0.1), np.full(50, 0.1 * DIVERGENCE_FACTOR * 1.5)])
    rule = DivergenceRule(scaled=False, baseline=None)
    step, (kind, reason) = feed(rule, step_rise)
    assert kind == "divergence" and step == onset + WINDOW_STEPS // 2  # 17 of the 32 window steps are high
    assert rule.baseline == pytest.approx(0.1) and "over 4 x the run's early level 0.1" in reason
    noisy_rise = np.concatenate([healthy[:onset], 20 * healthy[onset:onset + 50]])
    step, (kind, _) = feed(DivergenceRule(scaled=False, baseline=None), noisy_rise)
    assert kind == "divergence" and onset + 8 <= step <= onset + 24


def test_forty_noisy_runs_never_trip_and_a_20x_rise_always_trips_within_24_steps():
    """The stated behaviour of the divergence rule, on 40 seeded runs (σ = 1 in log: a heavy-tailed loss)."""
    latencies = []
    for seed in range(40):
        healthy = 0.1 * np.exp(np.random.default_rng(seed).normal(0.0, 1.0, 1000))
        assert feed(DivergenceRule(scaled=False, baseline=None), healthy) is None, seed
        trip = feed(DivergenceRule(scaled=False, baseline=None),
                    np.concatenate([healthy[:200], 20 * healthy[200:300]]))
        assert trip is not None and trip[1][0] == "divergence", seed
        latencies.append(trip[0] - 200)
    assert 8 <= min(latencies) and max(latencies) <= 24, latencies


def test_non_finite_values_trip_at_once_unless_a_loss_scaler_owns_them():
    rule = DivergenceRule(scaled=False, baseline=None)
    assert rule.judge(0, 0.1, 1.0) is None
    assert rule.judge(1, 0.1, math.inf)[0] == "nonfinite_grad"
    assert DivergenceRule(scaled=False, baseline=None).judge(0, math.nan, 1.0)[0] == "nonfinite_loss"
    scaled = DivergenceRule(scaled=True, baseline=None)
    results = [scaled.judge(s, loss, None) for s, loss in enumerate([math.nan, 0.1, math.nan, math.nan, math.nan])]
    assert results[:4] == [None] * 4 and SCALED_NONFINITE_STREAK == 3
    assert results[4][0] == "nonfinite_loss" and "3 steps in a row" in results[4][1]
    report = scaled.report(*results[4])
    assert report["step"] == 0 and report["loss_history"][0] == [0, None, None]


# ---------------------------------------------------------------- the guard on real tensors (CPU)

def toy(fused: bool) -> tuple[torch.nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4)
    return layer, torch.optim.AdamW(layer.parameters(), lr=0.1, fused=fused, foreach=None if fused else False)


def train_step(guard: StabilityGuard, layer, optimizer, step: int, *, poison: bool = False) -> None:
    loss = layer(torch.ones(2, 4)).pow(2).mean()
    if poison:
        loss = loss * float("nan")
    guard.add_loss(loss)
    loss.backward()
    guard.before_optimizer_step()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    guard.after_optimizer_step(step)


def test_fused_adamw_skips_a_nan_step_on_the_device_and_the_read_reports_it():
    layer, optimizer = toy(fused=True)
    extra: dict = {}
    guard = StabilityGuard(torch.device("cpu"), list(layer.parameters()), optimizer, scaled=False, extra=extra,
                           enabled=True)
    assert guard.fused
    for step in range(BASELINE_STEPS):
        train_step(guard, layer, optimizer, step)
    assert guard.report_loss() > 0 and extra[BASELINE_KEY] > 0  # the baseline travels in the counters
    before = [p.detach().clone() for p in layer.parameters()]
    train_step(guard, layer, optimizer, BASELINE_STEPS, poison=True)
    assert all(torch.equal(a, b) for a, b in zip(before, layer.parameters()))  # skipped on the device
    train_step(guard, layer, optimizer, BASELINE_STEPS + 1)  # the loop runs on until the next read
    with pytest.raises(Diverged) as caught:
        guard.report_loss()
    report = caught.value.report
    assert report["kind"] == "nonfinite_loss" and report["step"] == BASELINE_STEPS
    assert report["detected_at_step"] == BASELINE_STEPS + 2 and report["loss_history"][-1] == [BASELINE_STEPS, None,
                                                                                                 None]
    with pytest.raises(Diverged):  # it stays tripped: no save after it
        guard.before_save()
    assert all(torch.isfinite(p).all() for p in layer.parameters())


def test_other_optimizers_apply_the_bad_step_and_the_save_check_refuses_their_weights():
    layer, optimizer = toy(fused=False)
    guard = StabilityGuard(torch.device("cpu"), list(layer.parameters()), optimizer, scaled=False, extra={},
                           enabled=True)
    assert not guard.fused  # a non-fused AdamW refuses found_inf: the guard must not set it
    train_step(guard, layer, optimizer, 0)
    guard.before_save()  # finite: passes
    with torch.no_grad():
        layer.weight[0, 0] = float("inf")
    with pytest.raises(Diverged) as caught:
        guard.before_save()
    assert caught.value.report["kind"] == "nonfinite_weights"


def test_scaled_runs_leave_gradients_to_the_scaler_and_the_bench_switch_turns_checks_off(monkeypatch):
    layer, optimizer = toy(fused=True)
    scaled = StabilityGuard(torch.device("cpu"), list(layer.parameters()), optimizer, scaled=True, extra={},
                            enabled=True)
    train_step(scaled, layer, optimizer, 0, poison=True)
    assert not hasattr(optimizer, "found_inf")  # accelerate's GradScaler sets it, never both
    scaled.report_loss()  # one non-finite loss under a scaler is its business
    monkeypatch.setenv("SD_COMPAT_NO_DIVERGENCE_CHECK", "1")
    off = StabilityGuard(torch.device("cpu"), list(layer.parameters()), optimizer, scaled=False, extra={})
    assert not off.enabled
    train_step(off, layer, optimizer, 0, poison=True)
    assert math.isnan(off.report_loss())  # still summed for the progress bar, not judged


def test_injected_nan_fires_once_per_step_across_restarts(tmp_path):
    injector = NanInjector.from_env(tmp_path, {NAN_ENV: "step=3"})
    one = torch.ones(())
    assert injector.poison(2, one) is one
    assert torch.isnan(injector.poison(3, one))
    assert NanInjector.from_env(tmp_path, {NAN_ENV: "step=3"}).poison(3, one) is one  # marker: once
    assert NanInjector.from_env(tmp_path, {}) is None
    with pytest.raises(ValueError, match=NAN_ENV):
        NanInjector.from_env(tmp_path, {NAN_ENV: "lr_scale=10"})


def test_a_resumed_run_follows_the_lowered_learning_rate_and_its_longer_warmup(tmp_path):
    """A state saved at 1e-3 and resumed with 5e-4 and a 20-step warm-up runs at 5e-4 x 6/20 at step 6
    (optimizer and scheduler state restore the old rates; the recipe puts the configured ones back)."""
    from sd_scripts_compat.training.optim import make_lr_scheduler
    from sd_scripts_compat.training.recipe import _follow_configured_rates
    from sd_scripts_compat.training.train_state import TrainCounters, load_train_state, save_train_state

    def build(lr: float, warmup: int):
        layer, _ = toy(fused=True)
        optimizer = torch.optim.AdamW(layer.parameters(), lr=lr, fused=True)
        scheduler = make_lr_scheduler("constant_with_warmup", optimizer, num_training_steps=40,
                                      num_warmup_steps=warmup)
        return layer, optimizer, scheduler

    layer, optimizer, scheduler = build(1e-3, 4)
    for _ in range(6):
        layer(torch.ones(1, 4)).sum().backward()
        optimizer.step()
        scheduler.step()
    save_train_state(tmp_path / "s-state", lora_state={}, optimizer=optimizer, lr_scheduler=scheduler,
                     counters=TrainCounters(global_step=6), settings={})
    straight_lr = optimizer.param_groups[0]["lr"]
    for lr, warmup, expected in ((5e-4, 20, 5e-4 * 6 / 20), (1e-3, 4, straight_lr)):
        _, resumed, resumed_scheduler = build(lr, warmup)
        state = load_train_state(tmp_path / "s-state")
        configured = list(resumed_scheduler.base_lrs)
        resumed.load_state_dict(state.optimizer_state)
        resumed_scheduler.load_state_dict(state.lr_scheduler_state)
        assert resumed.param_groups[0]["lr"] == straight_lr  # what a plain load leaves: the old rate
        _follow_configured_rates(resumed, resumed_scheduler, configured)
        assert resumed.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-12)
        if lr == 1e-3:
            assert resumed.param_groups[0]["lr"] == straight_lr  # unchanged rates: the very same float
        resumed.step()
        resumed_scheduler.step()
        assert resumed.param_groups[0]["lr"] == pytest.approx(lr * min(1.0, 7 / warmup))


# ---------------------------------------------------------------- the real engine

def nonfinite_tensors(folder: Path) -> dict[str, int]:
    """File -> count of non-finite values, over every .safetensors under ``folder`` (LoRA files and states)."""
    bad: dict[str, int] = {}
    for path in sorted(folder.rglob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            count = sum(int((~torch.isfinite(handle.get_tensor(k))).sum()) for k in handle.keys()
                        if handle.get_tensor(k).is_floating_point())
        if count:
            bad[str(path.relative_to(folder))] = count
    return bad


def toy_dataset(root: Path, images: int = 4) -> Path:
    from PIL import Image

    folder = root / "data" / "1_toy"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(images):
        Image.fromarray((rng.random((64, 64, 3)) * 255).astype("uint8")).save(folder / f"img{i}.png")
        (folder / f"img{i}.caption").write_text(f"a toy picture number {i}")
    return folder.parent


@pytest.mark.long
@pytest.mark.parametrize("optimizer_args", [[], ["foreach=True"]], ids=["fused-adamw", "foreach-adamw"])
def test_engine_stops_on_an_injected_nan_writes_diverged_and_never_saves_non_finite(tmp_path, optimizer_args):
    """NaN at step 5 of 10, LoRA + state saved every 2 steps: the saves at 2 and 4 are made, the one at 6
    is refused (the fused kernel skipped the bad update; the foreach one applied it: NaN weights)."""
    out = tmp_path / "out"
    config = {"pretrained_model_name_or_path": "builtin:tiny-sd15", "train_data_dir": str(toy_dataset(tmp_path)),
              "output_dir": str(out), "output_name": "lora", "resolution": "32,32", "train_batch_size": 1,
              "max_train_steps": 10, "network_dim": 4, "network_alpha": 2, "learning_rate": 1e-3, "seed": 7,
              "caption_extension": ".caption", "max_data_loader_n_workers": 0, "save_every_n_steps": 2,
              "save_state": True, "optimizer_args": optimizer_args}
    (tmp_path / "config.toml").write_text(toml.dumps(config))
    events = tmp_path / "events"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", NAN_ENV: "step=5"}
    result = subprocess.run([sys.executable, "-m", "sd_scripts_compat.train_network", "--config_file",
                             str(tmp_path / "config.toml"), "--autotune_events_dir", str(events)],
                            capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert result.returncode == DIVERGED_EXIT_CODE, result.stderr[-2000:]
    assert "training diverged: the loss is nan at step 5" in result.stderr
    event = read_event(events, "diverged")
    assert "diverged" in EVENT_KINDS and event is not None
    assert event["kind"] == "nonfinite_loss" and event["step"] == 5 and event["max_train_steps"] == 10
    assert 6 <= event["detected_at_step"] <= 10
    history = event["loss_history"]
    assert [s for s, _, _ in history[:6]] == [0, 1, 2, 3, 4, 5] and history[5][1] is None
    assert all(loss is not None and loss > 0 for _, loss, _ in history[:5])
    assert TrainSettings.from_event(event["settings"]).learning_rate == 1e-3
    names = sorted(p.name for p in out.iterdir())
    assert "lora-step00000004.safetensors" in names and "lora-step00000004-state" in names
    assert not any(n.startswith(("lora-step00000006", "lora-step00000008")) for n in names) and "lora.safetensors" \
        not in names, names
    assert nonfinite_tensors(out) == {}


# ---------------------------------------------------------------- the watchdog (fake engine)

def fake_job(tmp_path: Path, rules: str, *, lr: float, **kw) -> Job:
    out = tmp_path / "out"
    out.mkdir()
    config = out / "config.toml"
    config.write_text(toml.dumps({
        "output_dir": str(out), "output_name": "lora", "max_train_steps": 20, "train_batch_size": 2,
        "gradient_accumulation_steps": 1, "resolution": "64,64", "optimizer_type": "AdamW", "network_dim": 8,
        "learning_rate": lr, "lr_scheduler": "constant"}))
    env = {"PATH": "/usr/bin:/bin", "FAKE_ENGINE": rules}
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return Job(config_path=config, output_dir=out, settings=fake_settings(toml.loads(config.read_text())),
               limits=LadderLimits(budget_mib=1e6), predict=fake_memory_mib, env=env, echo=False,
               engine=CompatEngine(entry=[str(FAKE)], save_state_every_s=kw.pop("save_state_every_s", 30.0)), **kw)


def test_watchdog_rolls_a_diverged_run_back_and_lowers_the_rate_once(tmp_path):
    job = fake_job(tmp_path, "diverge_at=5,diverge_lr_gt=1e-3,step_s=0.05", lr=1.6e-3, save_state_every_s=0.01)
    result = supervise(job)
    assert result.ok, result.message
    assert [r["failure"] for r in result.retries] == ["diverged"]
    record = result.retries[0]
    assert record["rung"] == "learning rate" and record["step"] == 5 and 1 <= record["resume_step"] <= 5
    assert record["changes"]["learning_rate"] == [1.6e-3, 8e-4]
    assert record["detection"]["kind"] == "nonfinite_loss"
    final = toml.load(job.output_dir / "config.final.toml")
    assert final["learning_rate"] == 8e-4 and final["lr_scheduler"] == "constant_with_warmup"
    assert final["lr_warmup_steps"] == 10  # 2 x step 5, at most half of the 20 steps
    with safe_open(result.output_file, "np") as handle:
        retries = json.loads(handle.metadata()["ss_autotune_retries"])
    assert retries[0]["failure"] == "diverged" and retries[0]["changes"]["learning_rate"] == [1.6e-3, 8e-4]
    log = (job.output_dir / DECISIONS_LOG).read_text()
    assert "diverged: attempt 0 failed: diverged at step 5" in log and "learning rate: learning_rate" in log


def test_watchdog_gives_up_with_one_message_when_every_rung_still_diverges(tmp_path):
    job = fake_job(tmp_path, "diverge_at=3", lr=1e-4)
    result = supervise(job)
    assert not result.ok and result.outcome == "unstable"
    assert [r.get("rung") for r in result.retries] == ["learning rate", "learning rate again"]
    assert len(result.attempts) == 3 and result.message.count("\n") == 0
    assert "nothing safer is left" in result.message and "the loss is nan at step 3" in result.message
    assert "unstable" in (job.output_dir / DECISIONS_LOG).read_text()


def test_a_state_that_diverges_again_right_after_the_resume_is_set_aside_and_the_run_restarts(tmp_path):
    """Halving is not enough from a damaged state: the retry diverges again at the same step, so the same
    settings run from step 0 (no rung used), then the next rung is taken from the fresh run's state."""
    job = fake_job(tmp_path, "diverge_at=5,diverge_lr_gt=5e-4,step_s=0.05", lr=1.6e-3, save_state_every_s=0.01)
    result = supervise(job)
    assert result.ok, result.message
    assert [r["rung"] for r in result.retries] == ["learning rate", "restart", "learning rate again"]
    restart = result.retries[1]
    assert restart["changes"] == {} and restart["resume_step"] == 0 and "already damaged" in restart["reason"]
    assert result.retries[2]["resume_step"] > 0  # a state of the fresh run, not a retired one
    assert list(job.output_dir.glob("*-state.retired"))
    assert toml.load(job.output_dir / "config.final.toml")["learning_rate"] == pytest.approx(2e-4)
    assert "restarting from step 0" in (job.output_dir / DECISIONS_LOG).read_text()
