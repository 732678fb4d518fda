"""Plans for the families musubi-tuner trains (Qwen-Image, FLUX.2 dev / klein, Wan 2.x, Z-Image): the memory
model against held-out fake-tensor traces of each full-size DiT, the fewest swapped blocks per card, and the files
``autotune plan --out`` writes for musubi-tuner: its dataset TOML (only ``docs/dataset_config.md``'s keys, caches
inside the output folder), its ``--config_file`` and the caching and training commands, every option checked
against the script's own option table (shipped, and equal to the reference's when that is beside the repo)."""

from __future__ import annotations

import csv
import shlex
import subprocess
from pathlib import Path

import pytest
import toml
from fixtures.held_out import check_held_out_traces
from fixtures.local import REFERENCE

from autotune.estimate.dit_memory import load_dit_calibration
from autotune.planning.planner import PlanRequest, Preferences, gpu_from_vram, plan_training
from autotune.planning.toml_writer import write_plan_files
from sd_scripts_compat.facts.families import get_family
from sd_scripts_compat.facts.musubi_args import MUSUBI_DATA, musubi_options

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("qwen-image", "flux2-dev", "flux2-klein-4b", "flux2-klein-9b", "wan2.2-t2v-a14b", "wan2.1-t2v-1.3b",
            "z-image")
TIERS = (12, 16, 24, 32)
# docs/dataset_config.md (reference README): the keys an image dataset config may hold
GENERAL_KEYS = {"resolution", "caption_extension", "batch_size", "num_repeats", "enable_bucket", "bucket_no_upscale"}
DATASET_KEYS = GENERAL_KEYS | {"image_directory", "image_jsonl_file", "cache_directory", "control_directory",
                               "multiple_target", "no_resize_control", "control_resolution"}
KINDS = {"flag": bool, "int": int, "float": (int, float), "str": str, "Path": str, "_int_or_float": (int, float),
         "list[str]": list, "list[float]": list}


def plan(family: str, tier: int, **prefs):
    return plan_training(PlanRequest(dataset_dir=None, model=f"./models/{family}.safetensors",
                                     family=get_family(family),
                                     gpus=(gpu_from_vram(tier),), cpu_physical_cores=8,
                                     preferences=Preferences(**prefs)))


@pytest.mark.parametrize("family", FAMILIES)
def test_memory_model_matches_full_size_traces_the_fit_did_not_use(family: str) -> None:
    """bench/calibrate_dit_memory.py's held-out traces of the family's full-size DiT (diffusers' class, musubi's
    LoRA modules): within 10 %, never more than 2 % low; swap counts up to musubi's maximum; video clips for Wan."""
    configs = check_held_out_traces(family)
    if get_family(family).musubi.get("video"):
        assert {c.get("frames", 1) for c in configs} >= {17, 33, 81}


@pytest.mark.parametrize("family", FAMILIES)
def test_more_vram_never_swaps_more_and_every_plan_fits_its_card(family: str) -> None:
    spec = get_family(family)
    plans = {tier: plan(family, tier) for tier in TIERS}
    fitting = [t for t in TIERS if plans[t].fits]
    assert fitting and fitting == list(TIERS[TIERS.index(fitting[0]):])  # more VRAM never stops fitting
    swaps = [plans[t].settings.blocks_to_swap for t in fitting]
    assert swaps == sorted(swaps, reverse=True) and max(swaps) <= spec.max_blocks_to_swap
    for tier in fitting:
        p = plans[tier]
        assert p.prediction.peak_bytes <= gpu_from_vram(tier).usable_bytes and p.prediction.it_per_s > 0
        assert p.launch_command[0] == "bash" and p.launch_command[-1].endswith("musubi_train.sh")


def _table_kinds(script: str) -> dict[str, tuple[str, tuple | None]]:
    return {name: (o.kind, o.choices) for name, o in musubi_options(script).items()}


def test_shipped_option_tables_equal_the_references() -> None:
    folder = REFERENCE / "musubi"
    if not folder.is_dir():
        pytest.skip(f"{folder} is not beside the repository")
    for shipped in sorted(MUSUBI_DATA.glob("*_args.tsv")):
        with (folder / f"musubi_{shipped.name}").open(encoding="utf-8") as fh:
            reference = {r["name"]: (r["kind"], r["default"], r["choices"]) for r in csv.DictReader(fh, delimiter="\t")}
        with shipped.open(encoding="utf-8") as fh:
            ours = {r["name"]: (r["kind"], r["default"], r["choices"]) for r in csv.DictReader(fh, delimiter="\t")}
        assert ours == reference, shipped.name


def _check_command(words: list[str]) -> None:
    """Every ``--option`` of one command line is its script's, with a value of its kind and choices."""
    script = next(Path(w).stem for w in words if w.endswith(".py"))
    table = _table_kinds(script)
    rest = words[[i for i, w in enumerate(words) if w.endswith(".py")][0] + 1:]
    i = 0
    while i < len(rest):
        name = rest[i].removeprefix("--")
        assert rest[i].startswith("--") and name in table, (script, rest[i])
        kind, choices = table[name]
        if kind == "flag":
            i += 1
            continue
        value = rest[i + 1]
        assert not value.startswith("--"), (script, name)
        if choices:
            assert value in map(str, choices), (script, name, value)
        i += 2


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tier", (12, 24))
def test_written_files_hold_only_musubis_keys_and_options(tmp_path: Path, family: str, tier: int) -> None:
    p = plan(family, tier)
    if not p.fits:
        pytest.skip(f"{family} does not fit {tier} GB: {p.message}")
    spec = get_family(family)
    out = tmp_path / "out"
    config_path, dataset_path = write_plan_files(p, out)
    assert sorted(f.name for f in out.iterdir()) == ["autotune_plan.json", "config.toml", "dataset.toml",
                                                      "musubi_train.sh"]
    table = _table_kinds(spec.kohya_script.removesuffix(".py"))
    config = toml.load(config_path)
    for key, value in config.items():
        assert key in table, f"{key} is not a {spec.kohya_script} option"
        kind, choices = table[key]
        assert isinstance(value, KINDS[kind]) and (kind == "flag" or not isinstance(value, bool)), (key, value)
        assert not choices or value in choices, (key, value, choices)
    assert config["network_module"] == spec.network_module and config["sdpa"] is True
    assert config["optimizer_type"] in ("adamw8bit", "adamw", "adafactor", "prodigyopt.Prodigy")
    assert config.get("fp8_scaled", False) == config.get("fp8_base", False)  # musubi's fp8_scaled needs fp8_base
    assert config.get("blocks_to_swap", 0) == p.settings.blocks_to_swap
    dataset = toml.load(dataset_path)
    assert set(dataset["general"]) <= GENERAL_KEYS
    for entry in dataset["datasets"]:
        assert set(entry) <= DATASET_KEYS and not Path(entry["cache_directory"]).is_absolute()
    assert len({e["cache_directory"] for e in dataset["datasets"]}) == len(dataset["datasets"])
    script = (out / "musubi_train.sh").read_text()
    subprocess.run(["bash", "-n", str(out / "musubi_train.sh")], check=True)
    commands = [shlex.split(line) for line in script.splitlines() if line.startswith(("python ", "accelerate "))]
    assert [Path(next(w for w in c if w.endswith(".py"))).name for c in commands] == [
        spec.musubi["cache_latents"], spec.musubi["cache_text_encoder_outputs"], spec.kohya_script]
    for command in commands:
        _check_command(command)
    fp8_te = spec.musubi.get("text_encoder_fp8")
    assert (f"--{fp8_te}" in commands[1]) == bool(fp8_te and p.kohya_values().get(fp8_te))
    assert ("--device" in commands[1]) == bool(p.kohya_values().get("text_encoder_cpu"))


# docs/dataset_config.md: a video dataset's keys
VIDEO_KEYS = {"video_directory", "video_jsonl_file", "cache_directory", "num_repeats", "target_frames",
              "frame_extraction", "frame_stride", "frame_sample", "max_frames", "source_fps"}


@pytest.mark.parametrize("family", ("wan2.1-t2v-1.3b", "wan2.2-t2v-a14b"))
def test_a_video_plan_states_its_clip_and_writes_a_video_dataset(tmp_path: Path, family: str) -> None:
    """A plan for clips of 33 frames: its settings and description carry the frames, the memory is the clip's
    (more than one frame's at the same size), and the dataset TOML names videos with musubi's clip keys."""
    clip, still = plan(family, 24, frames=33), plan(family, 24)
    assert clip.fits and clip.settings.frames == 33 and "x33 frames" in clip.settings.describe()
    if clip.settings.resolution == still.settings.resolution and clip.settings.train_batch_size == \
            still.settings.train_batch_size:
        assert clip.prediction.peak_bytes > still.prediction.peak_bytes
    _, dataset_path = write_plan_files(clip, tmp_path / "out")
    dataset = toml.load(dataset_path)
    for entry in dataset["datasets"]:
        assert set(entry) <= VIDEO_KEYS and entry["target_frames"] == [33] and "video_directory" in entry


def test_flux2_dev_caches_its_text_encoder_on_the_cpu_where_the_card_cannot_hold_it() -> None:
    """Mistral 3 (24 B) has no fp8 mode in musubi; on 24 GB the plan caches it with --device cpu and still
    trains on the card; on a 96 GB card it caches on the GPU."""
    small, large = plan("flux2-dev", 24), plan("flux2-dev", 96)
    assert small.fits and small.kohya_values().get("text_encoder_cpu") and "fp8_text_encoder" not in \
        small.kohya_values()
    assert not large.kohya_values().get("text_encoder_cpu")


@pytest.mark.long
def test_musubi_fp8_scaled_keeps_the_dequantized_copies_autograd_saves() -> None:
    """musubi's fp8_scaled hands F.linear a bf16 copy of each weight, which autograd keeps for the backward: traced
    on FLUX.2 klein 4B, without checkpointing the step holds about every block's bf16 weights more than in bf16
    (fp8 saves nothing there), with checkpointing only about one block's; the model carries both."""
    from autotune.calibration.dit_memtrace import trace_dit_step

    def act(gc: bool, fp8: bool) -> int:
        return trace_dit_step("flux2-klein-4b", resolution=256, rank=8, gradient_checkpointing=gc,
                              fp8_base=fp8).activations_peak_bytes

    arch = load_dit_calibration()["variants"]["flux2-klein-4b"]["architecture"]
    block_weights = [2 * g["fp8_elements"] for g in arch["block_groups"]]
    all_blocks = sum(size * g["count"] for size, g in zip(block_weights, arch["block_groups"]))
    no_gc, gc = act(False, True) - act(False, False), act(True, True) - act(True, False)
    assert 0.95 * all_blocks <= no_gc <= 1.05 * all_blocks
    assert 0 < gc <= 3 * max(block_weights)
    extra = load_dit_calibration()["variants"]["flux2-klein-4b"]["fp8_extra"]
    assert extra["no_gc"] >= 0.95 * all_blocks and 0 < extra["gc"] < extra["no_gc"] / 4


def test_wan22_trains_the_low_noise_expert_on_its_recommended_range() -> None:
    """Wan 2.2 A14B is two experts; a plan trains the one given with --dit (the low-noise expert) alone, on the
    timestep range musubi's docs recommend for it (T2V 0-875), with --preserve_distribution_shape; Wan 2.1 has one
    model and no range."""
    import toml

    from autotune.planning.musubi_writer import render_musubi_config
    from autotune.planning.planner import PlanRequest, gpu_from_vram, plan_training

    def config(family: str) -> dict:
        plan = plan_training(PlanRequest(dataset_dir=None, model=f"builtin:{family}", gpus=(gpu_from_vram(24),),
                                         cpu_physical_cores=8))
        return toml.loads(render_musubi_config(plan))

    wan22, wan21 = config("wan2.2-t2v-a14b"), config("wan2.1-t2v-1.3b")
    assert (wan22["min_timestep"], wan22["max_timestep"], wan22["preserve_distribution_shape"]) == (0, 875, True)
    assert "min_timestep" not in wan21 and "max_timestep" not in wan21
