"""Planning several cards (issue 53, item 2): data parallel or the transformer sharded, by predicted speed, with
the per-card memory of each and the reason; the sharded weights per card against the real modules' sizes (the
diffusers classes at full size on the meta device, split into our engine's units as training.sharding splits them).
No GPU here: the cards are catalogue entries."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import toml

from autotune.estimate.dit_memory import dit_family_calibration, sharded_transformer_bytes
from autotune.hardware.gpu_catalog import lookup_gpu
from autotune.planning.planner import PlanRequest, gpu_from_spec, nominal_dataset, plan_training
from sd_scripts_compat.facts.families import get_family

REPO = Path(__file__).resolve().parents[1]


def _plan(model: str, card: str, count: int, resolution: int = 1024):
    from autotune.planning.request import Preferences

    gpus = tuple(gpu_from_spec(lookup_gpu(card)) for _ in range(count))
    return plan_training(PlanRequest(dataset_dir=None, model=model, dataset=nominal_dataset(), gpus=gpus,
                                     cpu_physical_cores=16, preferences=Preferences(resolution=resolution)))


def _modules_sharded(family_name: str, ranks: int) -> int:
    """Bytes per process of the bf16 transformer built at full size on the meta device, split as the engine
    splits it: 1/N of every parameter, the root unit's whole, the last two blocks gathered, and the buffers
    (SD3.5's positional table) whole on each, as FSDP2 leaves them."""
    from sd_scripts_compat.models.build import build_modules
    from sd_scripts_compat.training.sharding import shard_units

    family = get_family(family_name)
    denoiser = build_modules(family, device="meta").unet
    units = shard_units(denoiser, family)
    blocks = [sum(p.numel() for p in unit.parameters()) * 2 for unit in units]
    total = sum(p.numel() for p in denoiser.parameters()) * 2
    buffers = sum(b.numel() * 2 for b in denoiser.buffers())
    return math.ceil(total / ranks) + (total - sum(blocks)) + sum(blocks[-2:]) + buffers


@pytest.mark.parametrize("family", ["flux-dev", "sd3.5-large", "chroma"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_the_sharded_weights_per_card_match_the_real_modules_split_as_the_engine_splits_them(family, ranks):
    arch = dit_family_calibration(family)["architecture"]
    shard, gathered = sharded_transformer_bytes(arch, ranks)
    traced = _modules_sharded(family, ranks)
    assert (shard + gathered) / traced == pytest.approx(1.0, abs=0.02)


def test_four_16_gb_cards_shard_flux_where_data_parallel_needs_fp8_and_swapped_blocks(tmp_path):
    plan = _plan("builtin:flux-dev", "RTX 4060 Ti 16GB", 4)
    assert plan.fits and plan.settings.fsdp == "full_shard" and not plan.settings.fp8_base
    assert plan.settings.blocks_to_swap == 0
    choices = {c.key: c for c in plan.choices}
    reason = choices["fsdp"].reason
    assert "sharded across 4 cards" in reason and "data parallel, which needs fp8 base weights" in reason
    assert "GiB per card" in reason and "samples/s" in reason  # both ways' figures
    assert plan.prediction.peak_bytes <= plan.prediction.usable_bytes
    assert "each with 1/N of the transformer" in choices["num_processes"].reason


def test_two_12_gb_cards_shard_with_each_share_in_host_ram_where_sharded_alone_needs_fp8_weights():
    """FLUX.1 dev in bf16 is 22 GiB: half of it and the gathered blocks do not fit 12 GB, so sharded alone needs fp8
    weights; the planner also offloads each process's share to host RAM, which keeps 16-bit weights at the same
    predicted speed, and prefers it to both sharded in fp8 and data parallel (fp8 and 19 swapped blocks)."""
    plan = _plan("builtin:flux-dev", "RTX 3060", 2)
    assert plan.fits and plan.settings.fsdp == "full_shard" and plan.settings.fsdp_offload_params
    assert not plan.settings.fp8_base and not plan.settings.blocks_to_swap
    choices = {c.key: c for c in plan.choices}
    reason = choices["fsdp"].reason
    assert reason.startswith("sharded across 2 cards (fsdp full_shard), each one's share in host RAM: 10.8 GiB")
    assert "as fast as data parallel, which needs fp8 base weights, blocks_to_swap 1-19 to fit (" in reason
    assert "as fast as sharded across 2 cards (fsdp full_shard), which needs fp8 base weights to fit (" in reason
    assert choices["fsdp_offload_params"].value is True and "sharded alone fits no card" in \
        choices["fsdp_offload_params"].reason
    assert plan.prediction.peak_bytes <= plan.prediction.usable_bytes
    written = plan.kohya_values()
    assert written["fsdp"] == "full_shard" and written["fsdp_offload_params"] is True


def test_two_8_gb_cards_shard_offloaded_where_data_parallel_is_as_fast_only_with_fp8_and_31_swapped_blocks():
    plan = _plan("builtin:flux-dev", "RTX 4060", 2)
    assert plan.settings.fsdp == "full_shard" and plan.settings.fsdp_offload_params and not plan.settings.fp8_base
    reason = next(c for c in plan.choices if c.key == "fsdp").reason
    assert "as fast as data parallel, which needs fp8 base weights, blocks_to_swap 1-31 to fit" in reason


def test_one_card_has_no_sharding_row_and_other_families_say_why_they_stay_data_parallel():
    one = _plan("builtin:flux-dev", "RTX 4060 Ti 16GB", 1)
    assert one.settings.fsdp is None and all(c.key not in ("fsdp", "sharding") for c in one.choices)
    for model, said in (("builtin:qwen-image", "musubi-tuner, which has no sharding of its own"),
                        ("builtin:lumina2", "sd-scripts, whose one way to shard the model is DeepSpeed ZeRO stage 3")):
        plan = _plan(model, "RTX 4090", 2)
        row = next(c for c in plan.choices if c.key == "sharding")
        assert plan.settings.fsdp is None and said in row.reason


def _cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autotune", *argv], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


def test_gpus_n_plans_n_of_that_card_and_the_config_carries_the_strategy(tmp_path):
    out = tmp_path / "cfg"
    done = _cli("plan", str(REPO / "examples" / "dataset"), "--model", "builtin:flux-dev", "--gpu", "RTX 4060 Ti 16GB",
                "--gpus", "4", "--resolution", "1024", "--out", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "4 x RTX 4060 Ti 16GB" in done.stdout
    config = toml.loads((out / "config.toml").read_text(encoding="utf-8"))
    assert config["fsdp"] == "full_shard" and "--num_processes 4" in (out / "config.toml").read_text()


@pytest.mark.parametrize(("argv", "said"), [
    (("--gpus", "3"), "--gpus N repeats one card"),
    (("--gpu", "RTX 3060", "--gpu", "RTX 4090", "--gpus", "2"), "--gpus N repeats one card"),
    (("--gpu", "RTX 3060", "--gpus", "0"), "--gpus 0: the number of cards"),
    (("--gpu", "RTX 3060", "--gpus", "99"), "--gpus 99: the number of cards"),
])
def test_a_bad_gpus_is_one_line(tmp_path, argv, said):
    done = _cli("plan", str(REPO / "examples" / "dataset"), "--model", "builtin:flux-dev", *argv, cwd=tmp_path)
    assert done.returncode == 2 and said in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_three_cards_and_two_different_cards_are_planned_per_card():
    """Three ranks shard FLUX.1's 57 blocks unevenly (each weight split by rows, padded: no block count need
    divide); two different cards are planned by the smaller one's memory and the slower one's speed."""
    three = _plan("builtin:flux-dev", "RTX 4060 Ti 16GB", 3)
    assert three.fits and three.prediction.peak_bytes <= three.prediction.usable_bytes
    cards = (gpu_from_spec(lookup_gpu("RTX 3060")), gpu_from_spec(lookup_gpu("RTX 4090")))
    mixed = plan_training(PlanRequest(dataset_dir=None, model="builtin:flux-dev", dataset=nominal_dataset(),
                                      gpus=cards, cpu_physical_cores=16))
    assert mixed.fits and mixed.prediction.usable_bytes == gpu_from_spec(lookup_gpu("RTX 3060")).usable_bytes


@pytest.mark.parametrize(("processes", "expected"), [(4, "fsdp"), (1, "blocks_to_swap")])
def test_the_oom_ladder_shards_before_it_swaps_when_the_run_has_several_processes(processes, expected):
    """FLUX.1 dev at 1024 px, bf16, out of memory on 16 GB cards at micro-batch 1 with checkpointing and an 8-bit
    optimizer: with four processes of our engine the next rung is sharding (within groups of two: half the
    transformer each fits by the peak the run measured), with one it is block swap."""
    from autotune.recovery.ladder import Decision, memory_predictor, next_settings

    family, failed, limits = _flux_oom(16, processes)
    predict = memory_predictor(family, cuda=True, processes=processes)
    step = next_settings(failed, limits, predict, measured_mib=16 * 1024)
    assert isinstance(step, Decision) and expected in step.changes
    if processes > 1:
        assert (step.settings.fsdp, step.settings.fsdp_shard_size) == ("hybrid_shard", 2)
        assert "sharding" in step.reasons[-1] and step.settings.shard_optimizer_state  # the milder rung first
        assert step.predicted_mib < 16 * 1024 and not step.settings.blocks_to_swap


@pytest.mark.parametrize(("card", "count", "offload"), [("RTX 4060 Ti 16GB", 2, True),
                                                       ("RTX 4060 Ti 16GB", 4, False), ("RTX 3060 12GB", 2, True)])
def test_the_processes_of_a_sharded_run_hold_the_transformer_in_host_ram_one_at_a_time(card, count, offload):
    """Every process (one per GPU) loads the model, but a sharded run's processes load in turn, each sharding its
    transformer before the next reads it (``training.sharding.in_turn``): the machine holds the bf16 transformer
    once, beside every process's text encoders and AE (and, offloaded, the shares already made)."""
    from autotune.estimate.dit_memory import denoiser_loading_bytes

    one, several = _plan("builtin:flux-dev", card, 1), _plan("builtin:flux-dev", card, count)
    p = several.prediction
    assert several.settings.fsdp == "full_shard" and several.settings.fsdp_offload_params is offload
    loading = dict(p.ram_components)["loading"]
    assert loading == dict(one.prediction.ram_components)["loading"]  # each reads the whole file in its turn
    transformer = denoiser_loading_bytes(get_family("flux-dev"))
    assert transformer == 2 * 11_901_408_320  # FLUX.1 dev's transformer in bf16 (22.2 GiB)
    assert p.ram_turn_bytes == transformer - (transformer // count if offload else 0)
    assert p.ram_peak_bytes == count * loading - (count - 1) * p.ram_turn_bytes  # loading sets the peak
    assert p.ram_peak_bytes == count * one.prediction.ram_peak_bytes - (count - 1) * p.ram_turn_bytes  # 1 card's
    assert several.to_dict()["prediction"]["ram_processes"] == count
    assert p.loading_processes == (f"{count} processes loading in turn (the denoiser's "
                                   f"{p.ram_turn_bytes / 2**30:.1f} GiB held by one at a time)")


def test_the_processes_of_a_data_parallel_run_load_at_once():
    """Unsharded, each process moves its whole model to its own card: they load at the same time, and the plan's
    host-RAM peak is one process's times the processes."""
    one, two = _plan("builtin:sdxl", "RTX 4090", 1), _plan("builtin:sdxl", "RTX 4090", 2, resolution=512)
    assert two.settings.fsdp is None and two.prediction.ram_turn_bytes == 0
    assert two.prediction.loading_processes == "2 processes loading at once"
    loading = dict(two.prediction.ram_components)["loaded_modules"]
    assert loading == dict(one.prediction.ram_components)["loaded_modules"]
    assert two.prediction.ram_peak_bytes >= 2 * loading


def test_too_little_ram_for_every_process_loading_is_warned_with_the_count():
    gpus = tuple(gpu_from_spec(lookup_gpu("RTX 4060 Ti 16GB")) for _ in range(4))
    from autotune.planning.request import Preferences

    plan = plan_training(PlanRequest(dataset_dir=None, model="builtin:flux-dev", dataset=nominal_dataset(), gpus=gpus,
                                     cpu_physical_cores=16, host_ram_bytes=64 * 2**30,
                                     preferences=Preferences(resolution=1024)))
    warning = next(w for w in plan.warnings if w.startswith("host RAM is the limit"))
    assert "predicted peak 71.2 GiB" in warning  # 4 x 34.4 GiB loading at once would be 137.7
    assert "4 processes (one per GPU) in turn, each keeping its text encoders" in warning


def test_the_oom_ladder_offloads_the_shares_of_a_sharded_run_that_still_runs_out_of_memory():
    """Sharded across 2 processes, FLUX.1 dev out of memory on 12 GB cards: the next rung keeps sharding and puts
    each process's share in host RAM (shard more, then offload), before any quality is given up."""
    from autotune.recovery.ladder import Decision, memory_predictor, next_settings

    family, failed, limits = _flux_oom(12, 2, fsdp="full_shard")
    step = next_settings(failed, limits, memory_predictor(family, cuda=True, processes=2), measured_mib=12 * 1024)
    assert isinstance(step, Decision) and step.settings.fsdp == "full_shard" and step.settings.fsdp_offload_params
    assert step.settings.network_dim == 32 and step.settings.resolution == (1024, 1024)
    assert "host RAM" in step.reasons[-1] and step.predicted_mib < 12 * 1024
    offloaded, sharded = (memory_predictor(family, cuda=True, processes=2)(s) for s in (step.settings, failed))
    assert offloaded < sharded - 10 * 1024  # each process's half of the 22 GiB transformer leaves its card


@pytest.mark.parametrize(("card", "batch"), [("RTX 4090", 2), ("RTX 3050", 2)])
def test_sdxl_on_two_cards_is_compared_sharded_against_data_parallel_by_its_resnet_and_transformer_blocks(card, batch):
    """SDXL is sharded by its ResNet and transformer blocks (87 units, the largest 94 MiB): half of its 4.9 GiB leaves
    each card, which fits a larger micro-batch; the fsdp row gives both ways' figures."""
    plan = _plan("builtin:sdxl", card, 2)
    fsdp = next(c for c in plan.choices if c.key == "fsdp")
    assert plan.settings.fsdp == "full_shard" and plan.settings.train_batch_size == batch
    assert re.search(r"faster than data parallel(, which needs rank 16 to fit)? \(", fsdp.reason)
    assert "GiB per card" in fsdp.reason
    assert plan.prediction.peak_bytes <= plan.prediction.usable_bytes


def test_sd35_large_on_two_12_gb_cards_is_sharded_with_its_weights_in_fp8():
    """SD3.5 Large sharded across two 12 GB cards fits only with fp8 weights, offloaded too; each process's share
    and each gather in float8 (the engine stores the weights in fp8 before it shards them), ahead of data parallel,
    which needs fp8 and swapped blocks as well; the config carries both keys."""
    plan = _plan("builtin:sd3.5-large", "RTX 3060", 2)
    assert plan.settings.fsdp == "full_shard" and plan.settings.fp8_base and not plan.settings.fsdp_offload_params
    assert not plan.settings.blocks_to_swap and plan.prediction.peak_bytes <= plan.prediction.usable_bytes
    reason = next(c for c in plan.choices if c.key == "fsdp").reason
    assert "data parallel, which needs fp8 base weights, blocks_to_swap 1-3 to fit" in reason
    assert "sharded across 2 cards (fsdp full_shard), each one's share in host RAM (" in reason
    written = plan.kohya_values()
    assert written["fsdp"] == "full_shard" and written["fp8_base"] is True


def test_the_oom_ladder_shards_a_run_in_fp8_and_keeps_its_fp8_weights():
    """FLUX.1 dev in fp8 on two 12 GB cards, data parallel, out of memory: the next rung shards it, the fp8 weights
    kept (each share in float8), before any block is swapped."""
    from autotune.recovery.ladder import Decision, memory_predictor, next_settings

    family, failed, limits = _flux_oom(12, 2, fp8_base=True)
    step = next_settings(failed, limits, memory_predictor(family, cuda=True, processes=2), measured_mib=12 * 1024)
    assert isinstance(step, Decision) and step.settings.fsdp == "full_shard" and step.settings.fp8_base
    assert not step.settings.blocks_to_swap and step.predicted_mib < 12 * 1024


@pytest.mark.parametrize(("model", "card"), [("builtin:flux-dev", "RTX 4060 Ti 16GB"), ("builtin:sdxl", "RTX 4090"),
                                            ("builtin:qwen-image", "RTX 4090"), ("builtin:lumina2", "RTX 4090")])
def test_several_cards_hold_one_copy_of_the_loras_gradients_whichever_trainer_runs_the_plan(model, card):
    """DDP as sd-scripts and musubi-tuner run a plan keeps a second copy of the LoRA's gradients unless
    ``ddp_gradient_as_bucket_view`` makes them views into its buckets: every plan over several cards writes it
    (musubi-tuner's options too) and counts no bucket copy. Our engine all-reduces one flat copy after the
    backward, when the activations are gone (the emulated card: a second process adds nothing that grows with
    the rank)."""
    from autotune.planning.search import all_reduce_bytes

    plan = _plan(model, card, 2)
    components = dict(plan.prediction.components)
    assert components["gradient_all_reduce"] == 0 and "ddp_buckets" not in components
    assert plan.kohya_values()["ddp_gradient_as_bucket_view"] is True
    if plan.family.trains_with.caches_apart:
        from autotune.planning.musubi_writer import training_options

        assert training_options(plan, plan.family)["ddp_gradient_as_bucket_view"] is True
    assert "ddp_gradient_as_bucket_view" not in _plan(model, card, 1).kohya_values()
    assert all_reduce_bytes({"lora_grads": 10, "activations": 4}) == 6


def test_four_24_gb_cards_shard_flux_within_two_groups_of_two_where_half_of_it_fits_a_card():
    """FLUX.1 dev at 1024 px on 4 x RTX 4090: half the transformer and its step fit one card, so two groups of two
    cards each shard one copy (``hybrid_shard``) and gather half of each block where sharding across all four
    gathers three quarters; as fast by the speed model (the step is compute-bound), and of two as fast the one
    that moves fewer bytes over the link wins. The per-card figure is a 2-process sharded run's."""
    from autotune.planning.search import estimate_for_settings

    plan = _plan("builtin:flux-dev", "RTX 4090", 4)
    s = plan.settings
    assert plan.fits and (s.fsdp, s.fsdp_shard_size, s.fp8_base, s.blocks_to_swap) == ("hybrid_shard", 2, False, 0)
    reason = next(c for c in plan.choices if c.key == "fsdp").reason
    assert reason.startswith("sharded within 2 groups of 2 cards (fsdp hybrid_shard): 17.4 GiB per card")
    assert "as fast as sharded across 4 cards (fsdp full_shard) (11.3 GiB per card" in reason
    assert "as fast as data parallel, which needs fp8 base weights to fit (" in reason
    assert "each group of 2 of the 4 cards" in next(c for c in plan.choices if c.key == "fsdp_shard_size").reason
    written = plan.kohya_values()
    assert (written["fsdp"], written["fsdp_shard_size"]) == ("hybrid_shard", 2)
    family = get_family("flux-dev")
    groups = estimate_for_settings(family, s, 16, devices=4)[0]
    across_two = estimate_for_settings(family, replace(s, fsdp="full_shard", fsdp_shard_size=0), 16, devices=2)[0]
    assert groups.peak_bytes == across_two.peak_bytes == plan.prediction.peak_bytes


def test_groups_of_cards_gather_fewer_bytes_and_are_faster_where_the_link_is_the_limit():
    """FLUX.1 dev at 512 px on 4 x RTX 4060 Ti 16GB (PCIe 4.0 x8) with an 8-bit optimizer: the step is short and
    the link narrow. The speed model moves (G - 1) / G of each block per process: across all 4 the gathers take
    longer than the step's compute, within groups of 2 (2/3 of those bytes) they hide behind it, as data parallel's
    step (no gathers) takes."""
    from autotune.planning.search import estimate_for_settings
    from sd_scripts_compat.facts.settings import TrainSettings

    family, card = get_family("flux-dev"), lookup_gpu("RTX 4060 Ti 16GB")
    s = TrainSettings(resolution=(512, 512), gradient_checkpointing=True, optimizer_type="AdamW8bit",
                      mixed_precision="bf16", cache_latents=True, cache_text_encoder_outputs=True,
                      network_train_unet_only=True)
    speed = {name: estimate_for_settings(family, replace(s, **kw), 16, devices=4)[1](card)
             for name, kw in (("all", {"fsdp": "full_shard"}), ("none", {}),
                              ("groups", {"fsdp": "hybrid_shard", "fsdp_shard_size": 2}))}
    assert speed["groups"].seconds_per_step == speed["none"].seconds_per_step < speed["all"].seconds_per_step


def test_the_oom_ladder_shards_within_groups_before_it_shards_across_every_process():
    """FLUX.1 dev in bf16, data parallel on four 24 GB cards, out of memory: the mildest sharding that fits is
    groups of two (half the transformer each); once that runs out too, across all four."""
    from autotune.recovery.ladder import Decision, memory_predictor, next_settings

    family, failed, limits = _flux_oom(24, 4)
    predict = memory_predictor(family, cuda=True, processes=4)
    step = next_settings(failed, limits, predict, measured_mib=24 * 1024)
    assert isinstance(step, Decision) and (step.settings.fsdp, step.settings.fsdp_shard_size) == ("hybrid_shard", 2)
    assert "fsdp_shard_size 0->2" in step.reasons[-1] and "1/G within groups of G" in step.reasons[-1]
    assert step.predicted_mib < 24 * 1024
    again = next_settings(step.settings, limits, predict, measured_mib=24 * 1024)
    assert isinstance(again, Decision) and (again.settings.fsdp, again.settings.fsdp_shard_size) == ("full_shard", 0)


def test_a_ladder_step_from_groups_to_every_process_leaves_no_group_size_in_the_config(tmp_path):
    """The ladder writes only what changed from the job's settings: a key the job's settings wrote and the new ones
    do not (``fsdp_shard_size`` after hybrid_shard, ``blocks_to_swap`` once none are swapped) is removed, not left
    to contradict them (the engine refuses a group size without hybrid_shard)."""
    from sd_scripts_compat.facts.settings import TrainSettings
    from sd_scripts_compat.facts.settings_space import settings_from_values, write_config

    job = TrainSettings(fsdp="hybrid_shard", fsdp_shard_size=2, mixed_precision="bf16")
    src, dst = tmp_path / "job.toml", tmp_path / "attempt.toml"
    src.write_text('fsdp = "hybrid_shard"\nfsdp_shard_size = 2\n[training]\nblocks_to_swap = 4\n',
                   encoding="utf-8")
    write_config(src, dst, replace(job, fsdp="full_shard", fsdp_shard_size=0), base=replace(job, blocks_to_swap=4))
    written = toml.loads(dst.read_text(encoding="utf-8"))
    assert written["fsdp"] == "full_shard" and "fsdp_shard_size" not in written
    assert "blocks_to_swap" not in written.get("training", {})
    assert settings_from_values(written).fsdp_shard_size == 0


def test_a_plan_of_groups_is_read_by_the_engine_as_written(tmp_path):
    out = tmp_path / "cfg"
    done = _cli("plan", str(REPO / "examples" / "dataset"), "--model", "builtin:flux-dev", "--gpu", "RTX 4090",
                "--gpus", "4", "--resolution", "1024", "--out", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    config = toml.loads((out / "config.toml").read_text(encoding="utf-8"))
    assert (config["fsdp"], config["fsdp_shard_size"]) == ("hybrid_shard", 2)
    from sd_scripts_compat.config.training_config import load_training_config

    read = load_training_config(["--config_file", str(out / "config.toml")], script="flux_train_network")
    assert (read.fsdp, read.fsdp_shard_size) == ("hybrid_shard", 2)


def _flux_oom(card_gib: int, processes: int, **changed):
    """FLUX.1 dev at 1024 px, bf16, rank 32, micro-batch 1 x 4 with checkpointing and AdamW8bit (and ``changed``),
    out of memory on ``card_gib`` GB cards in a run of ``processes`` of our engine: (family, failed settings, the
    ladder's limits)."""
    from autotune.recovery.ladder import LadderLimits
    from sd_scripts_compat.facts.settings import TrainSettings

    family = get_family("flux-dev")
    failed = TrainSettings(train_batch_size=1, gradient_accumulation_steps=4, resolution=(1024, 1024),
                           gradient_checkpointing=True, optimizer_type="AdamW8bit", network_dim=32,
                           network_train_unet_only=True, mixed_precision="bf16", cache_latents=True,
                           cache_text_encoder_outputs=True, **changed)
    limits = replace(LadderLimits.for_family(family, card_gib * 1024, fp8_supported=True, te_cache_allowed=True),
                     shard_processes=processes)
    return family, failed, limits
