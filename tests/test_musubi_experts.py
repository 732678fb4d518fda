"""Wan 2.2's two experts in one run (musubi's --dit_high_noise, --timestep_boundary, --offload_inactive_dit) and
pinned block swap (--use_pinned_memory_for_block_swap): the memory and speed models, the planner's choices, the
files it writes and the OOM ladder's moves."""

from __future__ import annotations

import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import toml

from autotune.estimate.dit_memory import DitMemoryInputs, predict_dit_memory, transformer_bytes
from autotune.estimate.dit_speed import expert_switch_share, predict_dit_speed
from autotune.hardware.gpu_catalog import lookup_gpu
from autotune.planning.planner import PlanRequest, Preferences, gpu_from_spec, gpu_from_vram, plan_training
from autotune.planning.request import GIB
from autotune.planning.toml_writer import write_plan_files
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.settings_space import OOM_POLICY, Limits, rungs

ROOT = Path(__file__).resolve().parents[1]
WAN22 = "wan2.2-t2v-a14b"


def wan(**changes) -> DitMemoryInputs:
    return DitMemoryInputs(**{"family": WAN22, "resolution": 960, "blocks_to_swap": 16, "fp8_base": True, **changes})


def plan(family: str, vram: float, *, ram_gb: float | None = None, gpu=None, files=(), **prefs):
    return plan_training(PlanRequest(
        dataset_dir=None, model=f"builtin:{family}", gpus=(gpu or gpu_from_vram(vram),), cpu_physical_cores=8,
        host_ram_bytes=None if ram_gb is None else int(ram_gb * GIB), preferences=Preferences(**prefs),
        model_files=tuple(files)))


def choice(p, key: str):
    return next(c for c in p.choices if c.key == key)


def test_both_experts_hold_two_resident_sets_on_the_card_and_two_swapped_sets_on_the_host() -> None:
    one, both = predict_dit_memory(wan()), predict_dit_memory(wan(high_noise_expert=True))
    offload = predict_dit_memory(wan(high_noise_expert=True, offload_inactive_dit=True, blocks_to_swap=0))
    alone = predict_dit_memory(wan(blocks_to_swap=0))
    from autotune.estimate.dit_memory import load_dit_calibration

    arch = load_dit_calibration()["variants"][WAN22]["architecture"]
    resident, host = transformer_bytes(arch, True, (16,))
    assert both.components["weights_inactive_expert"] == resident and one.components["weights_inactive_expert"] == 0
    assert both.training_peak_bytes - one.training_peak_bytes == pytest.approx(1.1 * resident, rel=1e-6)
    assert both.host_ram_bytes - one.host_ram_bytes == host  # the inactive expert's swapped blocks
    assert both.host_ram_loading_bytes - one.host_ram_loading_bytes == host  # the second loads beside them
    # offloading: the card holds one expert, the host the other one whole
    assert offload.training_peak_bytes == alone.training_peak_bytes
    assert offload.host_ram_bytes - alone.host_ram_bytes == sum(transformer_bytes(arch, True, (0,)))


def test_pinned_swap_locks_every_swapped_block_of_each_expert_and_copies_faster() -> None:
    gpu = lookup_gpu("RTX 4090")
    for experts in (1, 2):
        base = wan(high_noise_expert=experts == 2)
        pinned = predict_dit_memory(replace(base, pinned_block_swap=True))
        plain = predict_dit_memory(base)
        largest = plain.pinned_host_bytes // 2  # two staging copies of the largest swapped block
        assert pinned.pinned_host_bytes == experts * plain.swapped_bytes + largest
        assert pinned.host_ram_bytes == plain.host_ram_bytes - largest  # the staging copies are not needed
    small = wan(resolution=256, batch_size=1)  # a short step: the copies bound it
    assert predict_dit_speed(replace(small, pinned_block_swap=True), gpu).seconds_per_step < \
        predict_dit_speed(small, gpu).seconds_per_step


def test_the_expert_switch_share_is_musubis_sampling() -> None:
    """musubi's ``shift`` sampling (trainer_base: t = sigmoid(N(0,1)), shifted), one expert per micro-step chosen
    by its first timestep: the share of consecutive micro-steps on different experts, drawn."""
    import torch

    generator = torch.Generator().manual_seed(0)
    t = torch.sigmoid(torch.randn(400_000, generator=generator))
    t = t * 3.0 / (1 + 2.0 * t)
    high = t >= 0.875
    drawn = (high[1:] != high[:-1]).float().mean().item()
    assert expert_switch_share(0.875, 3.0) == pytest.approx(drawn, abs=0.004)


def test_offloading_costs_whole_expert_copies_at_each_switch() -> None:
    gpu = lookup_gpu("RTX 4090")
    alone = predict_dit_speed(wan(blocks_to_swap=0), gpu)
    offload = wan(high_noise_expert=True, offload_inactive_dit=True, blocks_to_swap=0, expert_switch_share=0.318)
    from autotune.estimate.dit_memory import load_dit_calibration

    cal = load_dit_calibration()
    arch = cal["variants"][WAN22]["architecture"]
    expert = sum(transformer_bytes(arch, True, (0,)))
    link = gpu.pcie_gbps * 1e9 * cal["speed"]["link_efficiency"]
    extra = predict_dit_speed(offload, gpu).seconds_per_step - alone.seconds_per_step
    assert extra == pytest.approx(0.318 * 2 * expert / link, rel=1e-6)


@pytest.mark.parametrize("vram", (12, 16, 24, 32))
def test_a_two_expert_plan_swaps_more_than_one_expert_and_writes_the_boundary(tmp_path: Path, vram: int) -> None:
    one, both = plan(WAN22, vram), plan(WAN22, vram, experts="both")
    assert both.fits and both.settings.high_noise_expert and not one.settings.high_noise_expert
    assert both.settings.blocks_to_swap > one.settings.blocks_to_swap
    assert both.prediction.peak_bytes <= both.prediction.usable_bytes
    keys = {c.key: c.value for c in both.choices}
    assert keys["timestep_boundary"] == 875 and "min_timestep" not in keys and "max_timestep" not in keys
    assert "preserve_distribution_shape" not in keys and keys["offload_inactive_dit"] is False
    assert "each expert" in choice(both, "blocks_to_swap").reason
    out = tmp_path / "plan"
    write_plan_files(both, out)
    config = toml.load(out / "config.toml")
    assert config["timestep_boundary"] == 875 and config["offload_inactive_dit"] is False
    assert config["blocks_to_swap"] == both.settings.blocks_to_swap
    train = [shlex.split(line) for line in (out / "musubi_train.sh").read_text().splitlines()
             if line.startswith("accelerate ")][0]
    assert train[train.index("--dit_high_noise") + 1] == "$DIT_HIGH_NOISE"
    subprocess.run(["bash", "-n", str(out / "musubi_train.sh")], check=True)


def test_both_experts_fit_a_large_card_without_swap() -> None:
    p = plan(WAN22, 48, experts="both")
    assert p.settings.blocks_to_swap == 0 and not p.settings.offload_inactive_dit
    assert "both experts fit on the card" in choice(p, "offload_inactive_dit").reason


def test_offloading_the_inactive_expert_wins_where_block_swap_is_bound_by_a_slow_link() -> None:
    """An eGPU on Thunderbolt (PCIe 3.0 x4, ~3.9 GB/s): swapping blocks of both experts every micro-step costs
    more than moving a whole expert on the third of micro-steps that switch; on a x16 link it is the other way."""
    spec = lookup_gpu("RTX 4090")
    egpu = gpu_from_spec(replace(spec, pcie_gbps=3.94), name="RTX 4090 (Thunderbolt)")
    slow = plan(WAN22, 24, gpu=egpu, ram_gb=128, experts="both", resolution=512)
    fast = plan(WAN22, 24, gpu=gpu_from_spec(spec), ram_gb=128, experts="both", resolution=512)
    assert slow.settings.offload_inactive_dit and slow.settings.blocks_to_swap == 0
    assert "waits whole in host RAM" in choice(slow, "offload_inactive_dit").reason
    assert not fast.settings.offload_inactive_dit and fast.settings.blocks_to_swap > 0
    assert "faster than offloading" in choice(fast, "offload_inactive_dit").reason
    training_ram = [dict(p.prediction.ram_components)["training"] for p in (slow, fast)]
    assert training_ram[0] > training_ram[1]  # a whole expert waits on the host
    starved = plan(WAN22, 24, gpu=egpu, ram_gb=16, experts="both", resolution=512)
    assert not starved.settings.offload_inactive_dit
    assert "GiB of RAM" in choice(starved, "offload_inactive_dit").reason


def test_pinned_block_swap_only_where_it_speeds_the_step_and_the_ram_allows() -> None:
    fast = plan("qwen-image", 12, ram_gb=64, resolution=512)
    assert fast.settings.use_pinned_memory_for_block_swap
    assert "bound the step" in choice(fast, "use_pinned_memory_for_block_swap").reason
    unknown = plan("qwen-image", 12, resolution=512)
    assert not unknown.settings.use_pinned_memory_for_block_swap
    assert "--ram" in choice(unknown, "use_pinned_memory_for_block_swap").reason
    small = plan("qwen-image", 12, ram_gb=20, resolution=512)
    assert not small.settings.use_pinned_memory_for_block_swap
    assert "at most half" in choice(small, "use_pinned_memory_for_block_swap").reason
    native = plan("qwen-image", 12, ram_gb=64)  # 1328 px: the copies hide behind the compute
    assert native.settings.blocks_to_swap and not native.settings.use_pinned_memory_for_block_swap
    assert "hide behind the compute" in choice(native, "use_pinned_memory_for_block_swap").reason
    assert fast.prediction.seconds_per_step < plan("qwen-image", 12, ram_gb=20, resolution=512) \
        .prediction.seconds_per_step
    no_swap = plan("qwen-image", 48, ram_gb=64)
    assert not any(c.key == "use_pinned_memory_for_block_swap" for c in no_swap.choices)


def test_the_oom_ladder_leaves_offloading_for_block_swap_of_both_experts() -> None:
    """musubi refuses block swap beside --offload_inactive_dit: the swap rung turns offloading off."""
    from sd_scripts_compat.facts.settings import TrainSettings

    s = TrainSettings(high_noise_expert=True, offload_inactive_dit=True, fp8_base=True)
    swap = next(c for name, _, c in rungs(s, OOM_POLICY, Limits(max_blocks_to_swap=39)) if name == "swap")
    assert swap and all(not c.settings.offload_inactive_dit and c.settings.high_noise_expert for c in swap)
    assert TrainSettings.from_event(s.to_event()) == s


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "builtin:qwen-image", "--experts", "both"], "has one DiT; only Wan 2.2 A14B trains two"),
    (["--model", "builtin:wan2.2-t2v-a14b", "--experts", "low", "--dit_high_noise", "{file}"],
     "--experts low with --dit_high_noise"),
    (["--model", "builtin:qwen-image", "--dit_high_noise", "{file}"], "takes no dit_high_noise file"),
])
def test_expert_options_that_do_not_apply_are_one_line(tmp_path: Path, argv: list[str], message: str) -> None:
    high = tmp_path / "high.safetensors"
    high.write_bytes(b"x")
    out = tmp_path / "out"
    argv = [a.replace("{file}", str(high)) for a in argv]
    done = subprocess.run([sys.executable, "-m", "autotune", "plan", str(ROOT / "examples" / "dataset"), *argv,
                           "--vram", "24", "--out", str(out)], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode != 0 and message in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert not out.exists()


def test_a_given_high_noise_file_trains_both_experts_and_is_the_scripts_default(tmp_path: Path) -> None:
    high = tmp_path / "wan2.2_t2v_high_noise_14B_fp16.safetensors"
    high.write_bytes(b"x")
    p = plan(WAN22, 24, files=[("dit_high_noise", str(high))])
    assert p.settings.high_noise_expert and choice(p, "dit_high_noise").value == str(high)
    write_plan_files(p, tmp_path / "out")
    script = (tmp_path / "out" / "musubi_train.sh").read_text()
    assert f': "${{DIT_HIGH_NOISE:={high}}}"' in script
    with pytest.raises(UserError, match="one DiT"):
        plan("z-image", 24, experts="both")


def test_an_attempt_that_leaves_offloading_for_block_swap_writes_both_keys(tmp_path: Path) -> None:
    """The OOM ladder's move from an offloading plan: the attempt's config turns offload_inactive_dit off and
    swaps blocks (musubi asserts the two never meet)."""
    from autotune.recovery.musubi import write_attempt_files

    p = plan(WAN22, 48, experts="both")
    write_plan_files(p, tmp_path)
    base = replace(p.settings, offload_inactive_dit=True)
    lower = replace(base, offload_inactive_dit=False, blocks_to_swap=6)
    config, _ = write_attempt_files(tmp_path / "config.toml", tmp_path / "dataset.toml", lower, base,
                                    tmp_path / "state", 1, (), "wan_train_network.py")
    values = toml.load(config)
    assert values["offload_inactive_dit"] is False and values["blocks_to_swap"] == 6
    assert values["timestep_boundary"] == 875


def test_the_wizard_asks_wan22_for_its_experts(tmp_path: Path) -> None:
    """`autotune wizard` with Wan 2.2: "Experts" is its question (--experts); both write the boundary, the default
    keeps the low-noise expert's range; a family with one DiT is not asked and refuses --experts both in one line."""
    def wizard(out: Path, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "autotune", "wizard", str(ROOT / "examples" / "dataset"),
                               "--gpu", "RTX 4090", "--yes", "--no-start", "--out", str(out), *extra],
                              capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
                              env={**__import__("os").environ, "COLUMNS": "400"})

    both = wizard(tmp_path / "both", "--model", f"builtin:{WAN22}", "--experts", "both")
    assert both.returncode == 0, both.stderr
    assert "Experts" in both.stdout and "(from --experts)" in both.stdout
    assert toml.load(tmp_path / "both" / "config.toml")["timestep_boundary"] == 875
    low = wizard(tmp_path / "low", "--model", f"builtin:{WAN22}")
    assert low.returncode == 0, low.stderr
    assert toml.load(tmp_path / "low" / "config.toml")["max_timestep"] == 875
    refused = wizard(tmp_path / "no", "--model", "builtin:qwen-image", "--experts", "both")
    assert refused.returncode != 0 and "has one DiT" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and not (tmp_path / "no").exists()


@pytest.mark.long
def test_gpu_validate_covers_the_musubi_families_and_steps_their_classes_on_the_cpu(tmp_path: Path) -> None:
    """bench/gpu_validate.py --musubi --dry-run: each family's plan for an emulated card, and the same case code
    stepping the family's own diffusers class at a small geometry (musubi's fp8_scaled and a swapped block where
    planned); the bench's own swap buffers are named beside the prediction."""
    import json

    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_validate.py"), "--dry-run", "--musubi",
                           str(tmp_path), "--dit-families", "qwen-image,wan2.2-t2v-a14b", "--dit-tiers", "12"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    cases = {c["family"]: c for c in json.loads((tmp_path / "summary.json").read_text())["cases"]}
    assert set(cases) == {"qwen-image", "wan2.2-t2v-a14b"}
    for case in cases.values():
        s = case["settings"]
        assert s["blocks_to_swap"] > 0 and s["fp8_base"] and case["bench_swap_buffers_bytes"] > 0
        tiny = case["dry_run_tiny"]
        assert tiny["timed_micro_steps"] == 2 and not tiny["oom"] and tiny["blocks_to_swap"] == 1
