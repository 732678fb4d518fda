"""The emulated card (``sd_scripts_compat.training.emulated_card``; ``autotune run --emulate-card MIB``): a card of a
given size on this CPU that counts our engine's live tensors and runs out of memory past its size, and what the
tuner does with it: plans for it, learns from it, steps up into its measured headroom and down before an OOM the
measured peak foresees. The card is real counting on real tensors of real runs; only the GPU is emulated."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import toml

from autotune.recovery.ladder import LadderLimits
from autotune.recovery.step_up import StepDown, StepUp, next_move, projected_mib
from sd_scripts_compat.facts.contract import is_oom_error
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.settings import TrainSettings
from sd_scripts_compat.training.emulated_card import CARD_ENV, EmulatedCard
from sd_scripts_compat.training.live_bytes import LiveBytesCounter

REPO = Path(__file__).resolve().parent.parent
DATASET = REPO / "examples" / "dataset"


def test_the_count_runs_out_of_memory_past_the_card_and_forgets_what_is_freed():
    import torch

    counter = LiveBytesCounter(limit=2**20)
    with counter.mode():
        kept = torch.zeros(2**17)  # 512 KiB
        for _ in range(4):
            torch.zeros(2**17)  # made and freed: never more than 1 MiB live
    assert counter.current == kept.untyped_storage().nbytes() and counter.peak == 2**20
    with pytest.raises(torch.OutOfMemoryError) as caught, counter.mode():
        more = [torch.zeros(2**17) for _ in range(2)]
        del more
    assert is_oom_error(caught.value) and "emulated card" in str(caught.value) and counter.peak > 2**20


@pytest.mark.parametrize("value", ["abc", "-3", "0", "nan", "inf"])
def test_a_bad_card_size_is_one_line_naming_the_variable(value):
    with pytest.raises(UserError, match=CARD_ENV):
        EmulatedCard.from_env({CARD_ENV: value})


def test_no_card_without_the_variable():
    assert EmulatedCard.from_env({}) is None and EmulatedCard.from_env({CARD_ENV: " "}) is None
    assert EmulatedCard.from_env({CARD_ENV: "12.5"}).size_mib == 12.5


# ---- the decision: carried to the data's largest batch, a step down before the OOM, else a step up


BASE = replace(TrainSettings(resolution=(256, 256)), train_batch_size=4, gradient_accumulation_steps=1)
SMALL = {"micro_batch": 4, "width": 256, "height": 192}
LARGEST = {"micro_batch": 4, "width": 256, "height": 256}


def _mib(s: TrainSettings) -> float:
    """A stand-in memory model: 10 MiB, +1 MiB per 16384 pixels of the micro-batch, x3 without checkpointing."""
    pixels = s.train_batch_size * s.resolution[0] * s.resolution[1]
    return 10.0 + pixels / 16384 * (1.0 if s.gradient_checkpointing else 3.0)


def _speed(s: TrainSettings) -> float:
    return s.train_batch_size * (1.0 if s.gradient_checkpointing else 1.3)


def _move(measured: float, budget: float, progress: dict, *, up: bool = True, settings: TrainSettings = BASE):
    return next_move(settings, limits=LadderLimits(budget_mib=budget), budget_mib=budget, measured_mib=measured,
                     progress=progress, predict=_mib, images_per_s=_speed, up=up)


def test_the_measured_peak_is_carried_from_the_largest_batch_so_far_to_the_largest_the_data_has():
    assert _mib(BASE) == pytest.approx(58.0)  # at 4 x 256 x 256
    progress = {"largest_batch": SMALL, "largest_bucket": LARGEST}
    assert projected_mib(BASE, 46.0, _mib, progress) == pytest.approx(46.0 * 58.0 / 46.0)
    assert projected_mib(BASE, 40.0, _mib, {}) == 40.0  # no sizes: as measured
    assert projected_mib(BASE, 40.0, _mib, {"largest_batch": LARGEST, "largest_bucket": SMALL}) == 40.0
    assert projected_mib(BASE, 40.0, _mib, {"largest_batch": {"micro_batch": "4"}, "largest_bucket": LARGEST}) == 40.0


def test_a_peak_that_will_not_fit_the_largest_batch_steps_down_before_the_oom():
    move = _move(46.0, 50.0, {"largest_batch": SMALL, "largest_bucket": LARGEST}, up=False)
    assert isinstance(move, StepDown) and move.decision.settings.train_batch_size == 2
    assert move.decision.settings.effective_batch == BASE.effective_batch
    assert "step down before running out of memory: measured 46.0 MiB" in move.reason
    assert "4 x 256x256 px, where the model carries it to 58.0 MiB" in move.reason and "50.0 MiB budget" in move.reason


def test_a_peak_that_fits_the_largest_batch_steps_up_only_when_asked_to():
    light = replace(BASE, train_batch_size=1, gradient_accumulation_steps=4, gradient_checkpointing=True)
    progress = {"largest_batch": {**SMALL, "micro_batch": 1}, "largest_bucket": {**LARGEST, "micro_batch": 1}}
    assert _move(13.0, 100.0, progress, up=False, settings=light) is None
    up = _move(13.0, 100.0, progress, settings=light)
    assert isinstance(up, StepUp) and up.settings.train_batch_size == 2
    assert "measured 13.0 MiB at the largest micro-batch so far (1 x 256x192 px)" in up.reason


def test_nothing_left_below_lets_the_run_go_on():
    assert _move(900.0, 5.0, {"largest_batch": SMALL, "largest_bucket": LARGEST}) is None


def test_the_engine_takes_each_change_once_in_order_and_only_what_it_can_make_in_the_process(tmp_path):
    from sd_scripts_compat.training.live_changes import ControlFile

    path = tmp_path / "control.json"
    control = ControlFile(path)
    assert control.poll() is None  # nothing asked

    def ask(**request: object) -> None:
        path.write_text(json.dumps(request), encoding="utf-8")
        os.utime(path, ns=(0, (path.stat().st_mtime_ns + 1_000_000)))  # a new write, whatever the clock's grain

    ask(id=1, gradient_checkpointing=False)
    assert control.poll() == {"id": 1, "gradient_checkpointing": False} and control.poll() is None
    ask(id=1, gradient_checkpointing=True)
    assert control.poll() is None  # an id already applied
    ask(id=2, train_batch_size=4)
    assert control.poll() is None  # a restart's change, not the process's
    ask(id=3, gradient_checkpointing="no")
    assert control.poll() is None
    path.write_text("{half", encoding="utf-8")
    assert control.poll() is None and ControlFile(None).poll() is None
    ask(id=4, gradient_checkpointing=True, cpu_offload_checkpointing=False)
    assert control.poll() == {"id": 4, "gradient_checkpointing": True, "cpu_offload_checkpointing": False}


# ---- real runs of our engine on the card


def _config(tmp_path: Path, name: str, **values: object) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(toml.dumps({"resolution": "256,256", "network_dim": 32, "optimizer_type": "AdamW",
                                "mixed_precision": "no", "max_data_loader_n_workers": 0, "caption_extension": ".txt",
                                "cache_latents": True, "seed": 1, "learning_rate": 1e-4, **values}), encoding="utf-8")
    return path


def _run(tmp_path: Path, name: str, dataset: Path, config: Path, *extra: str) -> Path:
    out = tmp_path / name
    done = subprocess.run([sys.executable, "-m", "autotune", "run", str(dataset), "--model", "builtin:tiny-sd15",
                           "--config", str(config), "--out", str(out), *extra],
                          capture_output=True, text=True, cwd=tmp_path, timeout=900,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _done(out: Path) -> dict:
    return json.loads((out / "logs" / "events" / "done.json").read_text(encoding="utf-8"))


def _retries(out: Path) -> list[dict]:
    path = out / "logs" / "retries.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else []


def test_our_engine_counts_its_tensors_on_the_card_as_the_memory_model_predicts_them(tmp_path):
    """Four steps on a card with room to spare: done.json carries the card's figures, its peak is the run's peak,
    and the memory model's view of the card (tensors alone) is within 15% of it; the store keeps the record under
    the emulated card, not this CPU."""
    from autotune.estimate.memory_view import MemoryView
    from autotune.measure.store import load_measurements
    from autotune.recovery.ladder import memory_predictor
    from sd_scripts_compat.facts.families import get_family

    config = _config(tmp_path, "c", max_train_steps=4, resolution="64,64", train_batch_size=2,
                     gradient_accumulation_steps=2, gradient_checkpointing=True)
    out = _run(tmp_path, "card", DATASET, config, "--emulate-card", "1000", "--no-step-up")
    done = _done(out)
    memory = done["memory"]
    assert memory["emulated_card_mib"] == 1000
    assert memory["emulated_card_peak_mib"] == pytest.approx(done["peak_memory"])
    settings = TrainSettings.from_event(done["settings"])
    model = memory_predictor(get_family("tiny-sd15"), cuda=False, memory=MemoryView(emulated=True))(settings)
    assert 0.85 < model / memory["emulated_card_peak_mib"] < 1.15, (model, memory)
    records = [r for r in load_measurements() if r.source == "run"]
    assert [r.device.startswith("emulated card on cpu:") for r in records] == [True]
    assert records[0].peak_memory_mib == pytest.approx(done["peak_memory"])
    # what stayed on the card between steps, as the model's resident parts predict it; a plan of other settings
    # on this card corrects each part by its own ratio
    from autotune.estimate.memory_model import resident_bytes
    from autotune.planning.planner import PlanRequest, nominal_dataset, plan_training
    from autotune.planning.search import estimate_for_settings

    estimate, _ = estimate_for_settings(get_family("tiny-sd15"), settings, 2, on_gpu=False,
                                        memory=MemoryView(emulated=True))
    assert records[0].resident_mib == pytest.approx(done["resident_memory"])
    assert records[0].resident_mib == pytest.approx(resident_bytes(estimate.components) / 2**20, rel=0.05)
    other = plan_training(PlanRequest(dataset_dir=None, model="builtin:tiny-sd15", dataset=nominal_dataset(),
                                      cpu_physical_cores=2, emulated_card_bytes=1000 * 2**20,
                                      measurements=tuple(records), measured_device=records[0].device))
    assert other.prediction.memory_source == "measured-scaled"
    assert "resident measured" in other.prediction.memory_basis, other.prediction.memory_basis


@pytest.mark.long
def test_a_run_held_back_by_a_pessimistic_model_steps_up_into_the_cards_headroom_in_the_process(tmp_path):
    """Micro-batch 2 x 2 with checkpointing on a 76 MiB card, the memory model 40% pessimistic: checkpointing off
    is predicted at 84 MiB, so the settings were chosen to fit. The measured peak (~33 MiB, 0.75x the biased model)
    puts it at ~62 MiB: within its first 20 steps the run turns checkpointing off in the process (one attempt, no
    restart), ends at step 30 with the same effective batch, never runs out of memory, and its LoRA says what
    trained last and why."""
    from safetensors import safe_open

    config = _config(tmp_path, "p", max_train_steps=30, train_batch_size=2, gradient_accumulation_steps=2,
                     gradient_checkpointing=True)
    out = _run(tmp_path, "up", DATASET, config, "--emulate-card", "76", "--memory-model-scale", "1.4")
    retries = _retries(out)
    assert [r["failure"] for r in retries] == ["step_up"] and retries[0]["step"] <= 20, retries
    assert retries[0]["changes"] == {"gradient_checkpointing": [True, False]} and retries[0]["in_process"]
    assert retries[0]["steps_lost"] == 0 and retries[0]["resume_step"] == retries[0]["step"]
    log = (out / "logs" / "decisions.log").read_text(encoding="utf-8")
    assert "step up in the process" in log and "resuming from" not in log  # one attempt
    done = _done(out)
    assert done["steps"] == 30 and done["peak_memory"] < 76 and not done["settings"]["gradient_checkpointing"]
    final = toml.loads((out / "config.final.toml").read_text(encoding="utf-8"))
    assert (final["train_batch_size"], final["gradient_accumulation_steps"]) == (2, 2)
    assert not final.get("gradient_checkpointing")
    with safe_open(done["output_file"], "np") as handle:
        metadata = handle.metadata()
    assert metadata["ss_gradient_checkpointing"] == "False"
    assert json.loads(metadata["ss_autotune_retries"])[0]["in_process"]
    peaks = [json.loads(line)["peak_memory_mib"] for line in (out / "logs" / "events" / "progress.jsonl")
             .read_text(encoding="utf-8").splitlines()]
    assert max(peaks) == pytest.approx(done["peak_memory"]) and min(peaks) < 0.7 * done["peak_memory"]


def _mixed_sizes(root: Path) -> Path:
    """Four 256 x 192 images with 10 repeats and four 256 x 256 ones with 1: with bucket_no_upscale, ten small
    micro-batches of 4 and one large one per epoch; with seed 23 the large one comes eleventh."""
    from PIL import Image

    for folder, size, count in (("10_small shape", (256, 192), 4), ("1_big shape", (256, 256), 4)):
        (root / folder).mkdir(parents=True)
        for i in range(count):
            Image.new("RGB", size, (40 * i, 90, 200 - 30 * i)).save(root / folder / f"{i}.png")
            (root / folder / f"{i}.txt").write_text(folder.split("_", 1)[1], encoding="utf-8")
    return root


def _largest_bucket_late(tmp_path: Path) -> tuple[Path, Path]:
    """(dataset, config) whose largest bucket comes at step 11: micro-batch 4 without checkpointing."""
    dataset = _mixed_sizes(tmp_path / "data")
    config = _config(tmp_path, "o", max_train_steps=20, train_batch_size=4, gradient_accumulation_steps=1,
                     gradient_checkpointing=False, seed=23, enable_bucket=True, bucket_no_upscale=True,
                     min_bucket_reso=128, max_bucket_reso=512)
    return dataset, config


@pytest.mark.long
def test_a_peak_that_will_not_fit_the_largest_bucket_steps_down_before_it_comes(tmp_path):
    """Micro-batch 4 without checkpointing on a 100 MiB card, the memory model 40% optimistic: the small buckets
    fit (~85 MiB), the large one would not (~109 MiB), and it comes at step 11. After the first step the measured
    peak, carried by the model to the large bucket, is over the card: the run steps down at a step boundary, with
    no out-of-memory error, and ends at step 20."""
    dataset, config = _largest_bucket_late(tmp_path)
    out = _run(tmp_path, "down", dataset, config, "--emulate-card", "100", "--memory-model-scale", "0.6")
    retries = _retries(out)
    assert [r["failure"] for r in retries][:1] == ["step_down"] and retries[0]["step"] < 11, retries
    assert "oom" not in [r["failure"] for r in retries] and retries[0]["steps_lost"] == 0
    assert all(r["changes"].get("train_batch_size", [0, 0])[1] != 4 for r in retries[1:])  # never back up to it
    log = (out / "logs" / "decisions.log").read_text(encoding="utf-8")
    assert "step down before running out of memory" in log and "the data's largest is 4 x 256x256 px" in log
    assert _done(out)["steps"] == 20


@pytest.mark.slow
def test_the_same_run_without_stepping_runs_out_of_memory_when_the_largest_bucket_comes(tmp_path):
    """The run above with --no-step-up: out of memory at the large bucket's step (11), a step down only then."""
    dataset, config = _largest_bucket_late(tmp_path)
    kept = _run(tmp_path, "kept", dataset, config, "--emulate-card", "100", "--memory-model-scale", "0.6",
                "--no-step-up")
    failures = [(r["failure"], r["step"]) for r in _retries(kept)]
    assert failures[:1] == [("oom", 10)], failures  # the large bucket's step (11) ran out: 10 were done
    assert _done(kept)["steps"] == 20
