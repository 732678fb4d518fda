"""The planner: dataset counting, family detection, and the search over the whole GPU catalogue.

Real memory and speed models, real catalogue; no GPU is needed because planning never touches one.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import pytest

from autotune.hardware.gpu_catalog import load_catalog, lookup_gpu
from autotune.planning.goals import target_views
from autotune.planning.planner import (
    GIB,
    GOAL_PROFILES,
    TINY_CPU_MAX_STEPS,
    DatasetSummary,
    PlanRequest,
    Preferences,
    detect_family,
    gpu_from_spec,
    gpu_from_vram,
    learning_rate,
    nominal_dataset,
    plan_training,
    scan_dataset,
)
from sd_scripts_compat.facts.errors import UserError

FAMILIES = ("sd15", "sd2", "sdxl")


def make_dataset(root: Path, folders: dict[str, int], caption_ext: str = ".txt") -> Path:
    """Empty files with image suffixes are enough: the planner counts, it never decodes."""
    for folder, count in folders.items():
        sub = root / folder
        sub.mkdir(parents=True)
        for i in range(count):
            (sub / f"img{i}.png").write_bytes(b"")
            if caption_ext:
                (sub / f"img{i}{caption_ext}").write_text("a caption\n", encoding="utf-8")
    return root


def plan_for(family: str, gpus=(), **kwargs):
    return plan_training(PlanRequest(dataset_dir=None, model=f"builtin:{family}", gpus=tuple(gpus),
                                     dataset=nominal_dataset(), cpu_physical_cores=8, **kwargs))


@pytest.fixture(scope="module")
def catalogue_plans():
    """Every catalogue card x family, planned once for the module."""
    plans = {}
    for spec in load_catalog():
        for family in FAMILIES:
            plans[(spec.name, family)] = (spec, plan_for(family, [gpu_from_spec(spec)]))
    return plans


# ------------------------------------------------------------------------------------------ dataset


def test_scan_dataset_counts_images_repeats_and_captions(tmp_path):
    root = make_dataset(tmp_path / "ds", {"10_my char": 3, "2_style": 5}, caption_ext=".caption")
    (root / "notes").mkdir()
    (root / "notes" / "x.jpg").write_bytes(b"")
    (root / "10_my char" / "readme.md").write_text("not an image", encoding="utf-8")
    summary = scan_dataset(root)
    assert [(Path(s.image_dir).name, s.num_repeats, s.class_tokens, s.num_images) for s in summary.subsets] == [
        ("10_my char", 10, "my char", 3), ("2_style", 2, "style", 5)]
    assert summary.num_images == 8
    assert summary.views_per_epoch == 3 * 10 + 5 * 2
    assert summary.caption_extension == ".caption"
    assert any("notes/" in w and "skipped" in w for w in summary.warnings)


def test_scan_dataset_images_at_top_level_form_one_subset(tmp_path):
    root = tmp_path / "flat"
    root.mkdir()
    for name in ("a.PNG", "b.webp", "c.bmp", "d.jpeg", "e.gif"):
        (root / name).write_bytes(b"")
    summary = scan_dataset(root)
    assert len(summary.subsets) == 1 and summary.subsets[0].num_images == 4 and summary.subsets[0].num_repeats == 1
    assert summary.caption_extension == ".txt"


def test_scan_dataset_errors_are_one_line(tmp_path):
    with pytest.raises(UserError, match="not found"):
        scan_dataset(tmp_path / "missing")
    (tmp_path / "empty" / "5_x").mkdir(parents=True)
    with pytest.raises(UserError, match="holds no images") as info:
        scan_dataset(tmp_path / "empty")
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------- family


def test_detect_family_builtin_and_errors():
    assert detect_family("builtin:sdxl").name == "sdxl"
    assert detect_family("builtin:sd2-v").v_parameterization
    with pytest.raises(UserError, match="unknown built-in"):
        detect_family("builtin:sd3")
    with pytest.raises(UserError, match="--family"):
        detect_family("builtin:sd15", "sdxl")
    with pytest.raises(UserError, match="not found"):
        detect_family("/no/such/model.safetensors")


def test_detect_family_from_diffusers_folder(tmp_path):
    for cross, prediction, expected in ((768, "epsilon", "sd15"), (1024, "epsilon", "sd2"),
                                        (1024, "v_prediction", "sd2-v"), (2048, "epsilon", "sdxl")):
        folder = tmp_path / f"{expected}"
        (folder / "unet").mkdir(parents=True)
        (folder / "scheduler").mkdir()
        (folder / "unet" / "config.json").write_text(json.dumps({"cross_attention_dim": cross}), encoding="utf-8")
        (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps({"prediction_type": prediction}),
                                                                    encoding="utf-8")
        assert detect_family(str(folder)).name == expected


def test_detect_family_from_safetensors_header(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    layouts = {
        "sd15": {"cond_stage_model.transformer.text_model.final_layer_norm.weight": np.zeros(2, np.float16)},
        "sd2": {"cond_stage_model.model.ln_final.weight": np.zeros(2, np.float16)},
        "sd2-v": {"cond_stage_model.model.ln_final.weight": np.zeros(2, np.float16), "v_pred": np.zeros(0)},
        "sdxl": {"conditioner.embedders.1.model.ln_final.weight": np.zeros(2, np.float16),
                 "conditioner.embedders.0.transformer.text_model.final_layer_norm.weight": np.zeros(2, np.float16)},
    }
    for expected, te_keys in layouts.items():
        path = tmp_path / f"{expected}.safetensors"
        save_file({"model.diffusion_model.out.0.weight": np.zeros(2, np.float16), **te_keys}, str(path))
        assert detect_family(str(path)).name == expected
    with pytest.raises(UserError, match="--family"):
        (tmp_path / "model.ckpt").write_bytes(b"x")
        detect_family(str(tmp_path / "model.ckpt"))
    assert detect_family(str(tmp_path / "model.ckpt"), "sd15").name == "sd15"


# -------------------------------------------------------------------------------- catalogue x family


def test_every_catalogue_card_and_family_fits_or_says_why(catalogue_plans):
    fitted = 0
    for (name, family), (_spec, plan) in catalogue_plans.items():
        if plan.fits:
            fitted += 1
            assert plan.prediction.peak_bytes <= plan.prediction.usable_bytes, (name, family)
            assert plan.prediction.it_per_s > 0 and plan.prediction.total_seconds > 0
            assert all(c.reason.strip() for c in plan.choices), (name, family)
        else:
            assert "nothing fits" in plan.message and "needs" in plan.message, (name, family)
            assert "\n" not in plan.message
    assert fitted >= len(catalogue_plans) * 0.9  # almost every card trains every family somehow


def test_precision_follows_compute_capability(catalogue_plans):
    for (name, family), (spec, plan) in catalogue_plans.items():
        if not plan.fits:
            continue
        cc = spec.cc_tuple
        precision = plan.settings.mixed_precision
        if cc is not None and cc < (8, 0):
            assert precision == "fp16", (name, family)
        elif cc is not None:
            assert precision == "bf16", (name, family)
        else:  # AMD: the catalogue's bf16 flag
            assert precision == ("bf16" if spec.bf16 else "fp16")
        if plan.settings.fp8_base:
            assert cc is not None and cc >= (8, 9), (name, family)


def test_degradation_never_grows_with_vram_within_an_architecture(catalogue_plans):
    """The true monotonic claim across cards: more memory never forces more fallbacks.

    (Micro-batch itself is not monotonic across cards: a bigger card may switch checkpointing off at a
    smaller batch because that is faster, and cards differ in speed; see the same-card test below.)
    """
    by_arch = defaultdict(list)
    for (name, family), (spec, plan) in catalogue_plans.items():
        by_arch[(spec.architecture, family)].append((spec.vram_gb, name, plan))
    checked = 0
    for key, rows in by_arch.items():
        rows.sort(key=lambda row: (row[0], row[1]))
        depths = [len(plan.fallbacks) if plan.fits else math.inf for _, _, plan in rows]
        for (vram_a, _, _), (vram_b, name_b, _), a, b in zip(rows, rows[1:], depths, depths[1:], strict=False):
            if vram_b > vram_a:
                assert b <= a, (key, name_b, depths)
                checked += 1
    assert checked > 20


@pytest.mark.parametrize("family", FAMILIES)
def test_same_card_more_vram_never_slower(family):
    """One card's rates, memory 4..80 GB: fallbacks never grow; at equal fallbacks throughput never drops."""
    spec = lookup_gpu("RTX 4090")
    previous = None
    for gb in (4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 48, 80):
        plan = plan_for(family, [gpu_from_spec(spec, vram_gb=gb)])
        depth = len(plan.fallbacks) if plan.fits else math.inf
        rate = plan.prediction.samples_per_s if plan.fits else 0.0
        if previous is not None:
            assert depth <= previous[0], (family, gb)
            if depth == previous[0]:
                assert rate >= previous[1] * (1 - 1e-9), (family, gb)
        previous = (depth, rate)
    assert previous[0] == 0  # 80 GB needs no fallback


def _stage(label: str, after_resolution: bool) -> int:
    if label.startswith("optimizer"):
        return 0
    if label.startswith("UNet only"):
        return 1
    if label.startswith("rank"):
        return 5 if after_resolution else 2
    if label.startswith("resolution"):
        return 3
    assert label.startswith("fp8"), label
    return 4


def test_fallbacks_follow_the_documented_order():
    """Shrinking memory walks optimizer -> UNet only -> rank -> resolution -> fp8 -> rank, in that order."""
    spec = lookup_gpu("RTX 4090")
    seen = set()
    for gb in (24, 12, 8, 6, 5, 4, 3):
        plan = plan_for("sd15", [gpu_from_spec(spec, vram_gb=gb)], priority="quality")
        stages, after = [], False
        for label in plan.fallbacks:
            stages.append(_stage(label, after))
            after = after or label.startswith(("resolution", "fp8"))
        assert stages == sorted(stages), plan.fallbacks
        seen.update(stages)
    assert {0, 1, 2} <= seen


# ---------------------------------------------------------------------------------------- rules


def test_deterministic_for_the_same_request():
    a = plan_for("sdxl", [gpu_from_spec(lookup_gpu("RTX 3060"))])
    b = plan_for("sdxl", [gpu_from_spec(lookup_gpu("RTX 3060"))])
    assert json.dumps(a.to_dict(), sort_keys=True) == json.dumps(b.to_dict(), sort_keys=True)


def test_several_gpus_smallest_card_decides_and_launch_command():
    small, big = lookup_gpu("RTX 3060"), lookup_gpu("RTX 3090")
    plan = plan_for("sdxl", [gpu_from_spec(big), gpu_from_spec(small)], goal="style")
    assert plan.fits and plan.num_processes == 2
    assert plan.prediction.usable_bytes == gpu_from_spec(small).usable_bytes
    assert plan.prediction.peak_bytes <= plan.prediction.usable_bytes
    values = plan.kohya_values()
    effective = values["train_batch_size"] * values["gradient_accumulation_steps"] * 2
    assert {c.key: c.value for c in plan.choices}["effective_batch"] == effective
    cmd = plan.launch_command
    assert cmd[:4] == ("accelerate", "launch", "--num_processes", "2") and "--multi_gpu" in cmd
    assert "sdxl_train_network.py" in cmd


def threads_flag(command) -> str:
    return command[list(command).index("--num_cpu_threads_per_process") + 1]


def test_the_launch_command_gives_a_cpu_step_the_physical_cores_and_a_gpu_step_one_thread():
    """accelerate turns --num_cpu_threads_per_process into OMP_NUM_THREADS: kohya's usual 1 on a GPU run, where
    the card does the step, would leave a CPU run one core. musubi's train command follows the same plan field."""
    from autotune.planning.musubi_writer import musubi_commands

    cpu = plan_for("sd15", [], cpu_memory_bytes=16 * GIB)
    assert cpu.cpu_threads == 8 and threads_flag(cpu.launch_command) == "8"
    gpu = plan_for("sd15", [gpu_from_spec(lookup_gpu("RTX 3060"))])
    assert gpu.cpu_threads == 1 and threads_flag(gpu.launch_command) == "1"
    musubi_cpu = plan_for("wan2.1-t2v-1.3b", [], cpu_memory_bytes=64 * GIB)
    assert threads_flag(musubi_commands(musubi_cpu)[-1]) == "8"
    assert cpu.to_dict()["cpu_threads"] == 8


@pytest.mark.long
def test_accelerate_launch_runs_the_cpu_plans_script_with_that_many_torch_threads(tmp_path):
    """The real accelerate, the plan's own words up to the script, the script swapped for one that prints torch's
    intra-op thread count; against kohya's usual 1 in the same command. torch caps the count at the usable cores."""
    import os
    import subprocess
    import sys

    plan = plan_training(PlanRequest(dataset_dir=None, model="builtin:sd15", gpus=(), dataset=nominal_dataset(),
                                     cpu_physical_cores=2, cpu_memory_bytes=16 * GIB))
    script = tmp_path / "threads.py"
    script.write_text("import torch; print('threads', torch.get_num_threads())\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}

    def threads(words: list[str]) -> str:
        at = next(i for i, w in enumerate(words) if w.endswith(".py"))
        command = [sys.executable, "-m", "accelerate.commands.launch", *words[2:at], "--cpu", str(script)]
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.split()[-1]

    words = list(plan.launch_command)
    assert threads(words) == str(min(2, len(os.sched_getaffinity(0))))
    words[words.index("--num_cpu_threads_per_process") + 1] = "1"
    assert threads(words) == "1"


def test_cpu_plan_is_fp32():
    plan = plan_for("sd15", [], cpu_memory_bytes=16 * GIB)
    assert plan.fits and plan.settings.mixed_precision == "no"
    assert "--mixed_precision" not in plan.launch_command
    reason = {c.key: c.reason for c in plan.choices}["mixed_precision"]
    assert "no native bf16" in reason


def test_cpu_with_native_bf16_plans_bf16_autocast():
    """A CPU with avx512_bf16 / AMX trains in bf16 autocast (LoRA fp32), predicted faster than its fp32 plan."""
    fp32 = plan_for("sd15", [], cpu_memory_bytes=16 * GIB)
    plan = plan_for("sd15", [], cpu_memory_bytes=16 * GIB, cpu_bf16=True)
    assert plan.fits and plan.settings.mixed_precision == "bf16"
    assert "--mixed_precision" in plan.launch_command and "bf16" in plan.launch_command
    reason = {c.key: c.reason for c in plan.choices}["mixed_precision"]
    assert "natively" in reason and "LoRA weights stay fp32" in reason
    assert plan.prediction.samples_per_s > fp32.prediction.samples_per_s
    assert plan.prediction.speed_source == "model"  # no measurements given


def test_nothing_fits_says_what_the_smallest_configuration_needs():
    plan = plan_for("sdxl", [gpu_from_vram(1.5)])
    assert not plan.fits
    assert "nothing fits" in plan.message and "GiB" in plan.message and "at least" in plan.message


def test_bad_goal_priority_preferences_are_user_errors():
    with pytest.raises(UserError, match="--goal"):
        plan_for("sd15", [gpu_from_vram(8)], goal="portrait")
    with pytest.raises(UserError, match="--priority"):
        plan_for("sd15", [gpu_from_vram(8)], priority="cheap")
    with pytest.raises(UserError, match="--resolution"):
        plan_for("sd15", [gpu_from_vram(8)], preferences=Preferences(resolution=500))
    with pytest.raises(UserError, match="--vram"):
        gpu_from_vram(0)


def test_pinned_resolution_follows_the_familys_own_bucket_rules():
    """--resolution is checked with the engine's own rule (``FamilySpec.resolution_problem``): the planner's own
    choice for a tiny family is accepted when pinned, and so is any size the engine trains it at."""
    from sd_scripts_compat.facts.families import get_family

    tiny = get_family("tiny-sd15")
    step = tiny.bucket_step
    chosen = plan_for("tiny-sd15").settings.resolution[0]
    assert plan_for("tiny-sd15", preferences=Preferences(resolution=chosen)).fits
    small = plan_for("tiny-sd15", preferences=Preferences(resolution=64))
    assert small.fits and small.settings.resolution[0] == 64
    assert small.kohya_values()["min_bucket_reso"] <= 64  # buckets never start above the resolution
    for bad in (16, 64 + step // 2, 8 * tiny.resolution):
        with pytest.raises(UserError, match=f"--resolution {bad}: tiny-sd15 trains at multiples of {step} px"):
            plan_for("tiny-sd15", preferences=Preferences(resolution=bad))
    with pytest.raises(UserError, match="--epochs 0"):
        plan_for("tiny-sd15", preferences=Preferences(epochs=0))


def test_steps_and_learning_rate_follow_the_documented_rule(tmp_path):
    root = make_dataset(tmp_path / "ds", {"10_a": 12, "3_b": 4})
    dataset = scan_dataset(root)
    for goal in ("character", "style", "concept"):
        plan = plan_training(PlanRequest(dataset_dir=str(root), model="builtin:sd15", goal=goal,
                                         gpus=(gpu_from_vram(24),), cpu_physical_cores=8))
        values = plan.kohya_values()
        effective = {c.key: c.value for c in plan.choices}["effective_batch"]
        target = target_views(GOAL_PROFILES[goal], dataset.num_images, "balanced")
        epochs = max(1, round(target / dataset.views_per_epoch))
        assert values["max_train_epochs"] == epochs
        assert plan.prediction.optimizer_steps == epochs * math.ceil(dataset.views_per_epoch / effective)
        assert values["unet_lr"] == learning_rate(GOAL_PROFILES[goal], effective)
        assert values["text_encoder_lr"] == [pytest.approx(values["unet_lr"] / 2, rel=1e-2)]
        assert values["network_alpha"] == values["network_dim"] // 2
        assert values["lr_warmup_steps"] == round(0.05 * plan.prediction.optimizer_steps)


def test_preferences_are_respected_when_they_fit():
    plan = plan_for("sd15", [gpu_from_vram(24)],
                    preferences=Preferences(optimizer="Prodigy", rank=8, resolution=448, epochs=3))
    values = plan.kohya_values()
    assert values["optimizer_type"] == "Prodigy" and values["unet_lr"] == 1.0
    assert values["network_dim"] == 8 and values["resolution"] == "448,448" and values["max_train_epochs"] == 3
    assert all(item.count("=") == 1 for item in values["optimizer_args"])


def test_sdxl_caches_text_encoder_outputs_only_for_unet_only_training():
    unet_only = plan_for("sdxl", [gpu_from_vram(48)]).kohya_values()
    assert unet_only["network_train_unet_only"] and unet_only["cache_text_encoder_outputs"]
    with_te = plan_for("sdxl", [gpu_from_vram(80)], preferences=Preferences(train_text_encoder=True)).kohya_values()
    assert "cache_text_encoder_outputs" not in with_te and "network_train_unet_only" not in with_te
    sd15 = plan_for("sd15", [gpu_from_vram(6)]).kohya_values()
    assert "cache_text_encoder_outputs" not in sd15


@pytest.mark.parametrize(("family", "twin"), [("tiny-sd15", "sd15"), ("tiny-sdxl", "sdxl")])
def test_tiny_families_plan_buckets_like_their_full_size_twins(family, twin, tmp_path):
    """The tiny twins' VAEs downsample 8x: whatever resolution a user types, the bucket keys are the
    full-size twin's at that resolution (64 px steps, min bucket half the resolution, never below 256);
    a CPU plan is still capped to a short run."""
    root = make_dataset(tmp_path / "ds", {"2_a": 4})
    for resolution in (None, 512, 1024):
        tiny = plan_training(PlanRequest(dataset_dir=str(root), model=f"builtin:{family}", gpus=(),
                                         cpu_physical_cores=8, cpu_memory_bytes=16 * GIB,
                                         preferences=Preferences(resolution=resolution)))
        full = plan_for(twin, [gpu_from_vram(141)], preferences=Preferences(resolution=resolution or 256))
        values, expected = tiny.kohya_values(), full.kohya_values()
        assert values["resolution"] == f"{resolution or 256},{resolution or 256}"
        for key in ("resolution", "bucket_reso_steps", "min_bucket_reso", "max_bucket_reso"):
            assert values[key] == expected[key], (resolution, key)
        assert values["bucket_reso_steps"] == 64
        # 8 views per epoch, effective batch 4: 2 steps an epoch, as many epochs as fit in 40 steps
        assert tiny.prediction.optimizer_steps == TINY_CPU_MAX_STEPS == 40


def test_dataset_summary_views_per_epoch():
    summary = DatasetSummary(root="x", subsets=nominal_dataset().subsets, caption_extension=".txt")
    assert summary.views_per_epoch == 200 and summary.num_images == 20


@pytest.mark.slow
def test_gpu_validate_dry_run_trains_at_planned_settings(tmp_path):
    """bench/gpu_validate.py's CPU path: plan for an emulated 8 GB card, train the tiny twin at those settings."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(repo / "bench" / "gpu_validate.py"), "--dry-run", str(tmp_path),
                           "--families", "sd15", "--dit-families", "", "--compile-check", "", "--layout-check", "",
                           "--tiers", "8",
                           "--steps", "1", "--warmup", "1"],
                          cwd=repo, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text(encoding="utf-8"))
    (case,) = summary["cases"]
    assert case["family"] == "sd15" and case["tier_gb"] == 8 and not case["oom"]
    assert case["timed_micro_steps"] >= 1 and case["measured_it_per_s"] > 0
    assert case["predicted_peak_bytes"] <= case["usable_bytes"]
    assert (tmp_path / "sd15_8gb.json").is_file()


def test_gpu_validate_lists_the_layout_and_compile_checks_as_skipped_once_the_budget_is_spent(tmp_path):
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(repo / "bench" / "gpu_validate.py"), "--dry-run", str(tmp_path),
                           "--families", "", "--dit-families", "", "--budget", "0"],
                          cwd=repo, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    cases = json.loads((tmp_path / "summary.json").read_text(encoding="utf-8"))["cases"]
    assert [(c["case"], c["family"]) for c in cases] == [("layout", "sdxl"), ("compile", "sdxl"),
                                                          ("compile", "flux-dev")]
    assert all(c["would_measure"] == "skipped: time budget spent" for c in cases)
    assert not (tmp_path / "layout_check.json").exists() and not (tmp_path / "compile_check.json").exists()


@pytest.mark.parametrize("family", ["tiny-sd15", "tiny-sdxl"])
def test_tiny_family_plan_cli_subprocess(family, tmp_path):
    """The README quickstart's plan: `autotune plan DATASET --model builtin:tiny-* --json` as a user runs it,
    on the tiny family's own calibration. Without a GPU it is a CPU plan at the tiny native size, in bf16 where
    this CPU computes bf16 natively (the probe's flags), else fp32."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    examples = repo / "examples" / "dataset"
    dataset = examples if examples.is_dir() else make_dataset(tmp_path / "ds", {"10_sks cat": 6})
    done = subprocess.run([sys.executable, "-m", "autotune", "plan", str(dataset), "--model", f"builtin:{family}",
                           "--json"], cwd=repo, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["fits"] and plan["family"] == family
    assert plan["prediction"]["peak_bytes"] <= plan["prediction"]["usable_bytes"]
    if plan["device"] == "CPU":
        from autotune.hardware.probe import probe_cpu

        assert plan["settings"]["mixed_precision"] == ("bf16" if probe_cpu().bf16_native else "no")
        assert plan["settings"]["resolution"] == [256, 256]  # the tiny native size: 32x32 latents


def test_a_pinned_split_that_forces_rank_and_resolution_down_says_so_and_strict_refuses():
    """SDXL on 8 GB: the planner's own 1 x 4 keeps rank 32 at 1024 px; a pinned micro-batch 4 fits only at rank 8
    and 640 px, which the plan now says (it said only "lowered from 32 to fit memory"), and --strict refuses."""
    card = [gpu_from_vram(8)]
    own = plan_for("sdxl", card)
    assert own.pin_costs == () and own.settings.network_dim == 32 and own.settings.resolution == (1024, 1024)
    pinned = plan_for("sdxl", card, preferences=Preferences(batch=4))
    assert pinned.settings.train_batch_size == 4
    (line,) = pinned.pin_costs
    assert "your micro-batch 4 x 1 forces rank 32 -> 8, resolution 1024 -> 640" in line
    assert "the planner's 1 x 4 keeps rank 32 at 1024 px" in line
    assert pinned.to_dict()["pin_costs"] == [line]
    with pytest.raises(UserError, match="--strict: your micro-batch 4 x 1 forces"):
        plan_for("sdxl", card, preferences=Preferences(batch=4), strict=True)
    fits = plan_for("sdxl", [gpu_from_vram(24)], preferences=Preferences(batch=2), strict=True)
    assert fits.pin_costs == () and fits.settings.train_batch_size == 2  # a pin that costs nothing is planned


def test_the_bucket_and_checkpoint_reasons_say_what_their_numbers_are():
    """At 256 px the smallest bucket side is the resolution itself (it said "half the resolution"); a one-epoch
    run leaves one LoRA (it said "about four checkpoints")."""
    def reason(plan, key):
        return next(c for c in plan.choices if c.key == key)

    tiny = plan_for("tiny-sd15", [gpu_from_vram(8)])
    assert reason(tiny, "min_bucket_reso").value == 256 == tiny.settings.resolution[0]
    assert reason(tiny, "min_bucket_reso").reason.startswith("the resolution itself (256 px)")
    full = plan_for("sd15", [gpu_from_vram(8)])
    assert reason(full, "min_bucket_reso").value == 256 and reason(full, "min_bucket_reso").reason.startswith("half")
    epochs = reason(full, "max_train_epochs").value
    every = reason(full, "save_every_n_epochs")
    files = len([e for e in range(1, epochs) if e % every.value == 0]) + 1  # sd-scripts: epoch saves, then the last
    assert every.reason.startswith(f"{files} LoRA files to compare, one every {every.value} epoch")
    one = plan_for("sd15", [gpu_from_vram(8)], preferences=Preferences(epochs=1))
    assert reason(one, "save_every_n_epochs").reason == "a one-epoch run: the LoRA at its end is the only one"
