"""FLUX.1 plans: the fewest swapped blocks that fit, fp8 T5 where caching needs it, and configs that
sd-scripts' flux_train_network.py accepts (keys and types from its argument list; its own parser locally)."""

from __future__ import annotations

import csv
import math
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import toml
from fixtures.local import REFERENCE, SD_SCRIPTS_SKIP
from fixtures.local import sd_scripts as local_sd_scripts

from autotune.hardware.gpu_catalog import lookup_gpu
from autotune.planning.planner import PlanRequest, Preferences, gpu_from_spec, gpu_from_vram, plan_training
from autotune.planning.search import Predictor
from autotune.planning.toml_writer import write_plan_files
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import get_family

try:
    FLUX = get_family("flux-dev")
except (UserError, KeyError, FileNotFoundError):  # the family data lands with the flux-model branch
    pytest.skip("family flux-dev not in this checkout", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
ARG_TABLES = [ROOT / "sd_scripts_compat" / "data" / "kohya_flux_train_network_args.tsv",
              REFERENCE / "kohya" / "flux_train_network_args.tsv"]
SD_SCRIPTS, SD_PYTHON = local_sd_scripts()
TIERS = (8, 10, 12, 16, 24)


def flux_plan(gpu, **prefs):
    return plan_training(PlanRequest(dataset_dir=None, model="./models/flux-dev.safetensors",
                                     family=get_family("flux-dev"),
                                     gpus=(gpu,), cpu_physical_cores=8, preferences=Preferences(**prefs)))


def test_rtx_4070_plan_swaps_the_fewest_blocks_that_fit() -> None:
    gpu = gpu_from_spec(lookup_gpu("RTX 4070"))
    plan = flux_plan(gpu)
    assert plan.fits, plan.message
    s, values = plan.settings, plan.kohya_values()
    assert s.blocks_to_swap > 0 and s.fp8_base and s.cache_text_encoder_outputs and s.network_train_unet_only
    assert values["network_module"] == "networks.lora_flux" and values["blocks_to_swap"] == s.blocks_to_swap
    assert {"clip_l", "t5xxl", "ae"} <= set(values)
    # one block fewer does not fit at any micro-batch or checkpointing setting
    predictor = Predictor(FLUX, (gpu,), 8)
    fewer = replace(s, blocks_to_swap=s.blocks_to_swap - 1)
    for mb in (1, 2, 4):
        for gc in (False, True):
            assert predictor.predict(replace(fewer, train_batch_size=mb, gradient_checkpointing=gc)).required \
                > gpu.usable_bytes
    reasons = {c.key: c.reason for c in plan.choices}
    assert "fewest swapped blocks" in reasons["blocks_to_swap"] and "host RAM" in reasons["blocks_to_swap"]
    assert plan.prediction.peak_bytes <= gpu.usable_bytes and plan.prediction.ram_peak_bytes > 8 * 2**30
    assert plan.prediction.it_per_s > 0 and plan.launch_command[-3] == "flux_train_network.py"


def test_tiers_swap_fewer_blocks_as_vram_grows_and_small_cards_take_an_fp8_t5() -> None:
    plans = {tier: flux_plan(gpu_from_vram(tier), rank=16) for tier in TIERS}
    assert all(p.fits for p in plans.values())
    swaps = [plans[t].settings.blocks_to_swap for t in TIERS]
    assert swaps == sorted(swaps, reverse=True) and swaps[-1] == 0 and swaps[0] <= 35
    t5 = {t: plans[t].kohya_values()["t5xxl"] for t in TIERS}
    assert "fp8" in t5[8] and "fp8" in t5[10] and "fp8" not in t5[24]


def _arg_table() -> dict[str, tuple[str, str]]:
    table = next((p for p in ARG_TABLES if p.is_file()), None)
    if table is None:
        pytest.skip("no flux_train_network argument table here")
    with table.open(encoding="utf-8") as fh:
        return {row["name"]: (row["kind"], row["choices"]) for row in csv.DictReader(fh, delimiter="\t")}


@pytest.mark.parametrize("tier", TIERS)
def test_written_flux_config_holds_only_flux_train_network_options(tmp_path: Path, tier: int) -> None:
    plan = flux_plan(gpu_from_vram(tier))
    config_path, dataset_path = write_plan_files(plan, tmp_path)
    table = _arg_table()
    values = toml.load(config_path)
    # the reference table's notation and the shipped table's (argparse's words for the same kinds)
    kinds = {"flag": bool, "store_true": bool, "int": int, "float": float, "str": str, "Path": str,
             "list[str]": list, "str[nargs=*]": list, "list[float]": list, "float[nargs=*]": list,
             "int_or_float": (int, float)}
    for key, value in values.items():
        assert key in table, f"{key} is not a flux_train_network.py option"
        kind, choices = table[key]
        flag = kinds[kind] is bool
        assert isinstance(value, kinds[kind]) and (flag or not isinstance(value, bool)), (key, value)
        if choices and choices.startswith("["):
            assert repr(value) in choices, (key, value)
        elif choices:
            assert str(value) in choices.split("|"), (key, value)
    data = toml.load(dataset_path)
    assert data["datasets"][0]["bucket_reso_steps"] % 32 == 0  # flux_train_network verifies multiples of 32


SD_CHECK = """
import sys, toml
sys.path.insert(0, sys.argv[1])
config, dataset = sys.argv[2], sys.argv[3]
sys.argv = ["flux_train_network.py", "--config_file", config]
import flux_train_network
from library import config_util, train_util
parser = flux_train_network.setup_parser()
args = train_util.read_config_from_file(parser.parse_args(), parser)
known = {a.dest for a in parser._actions}
unknown = [k for k in toml.load(config) if k not in known]
assert not unknown, unknown
sanitizer = config_util.ConfigSanitizer(True, False, False, True)
sanitizer.sanitize_user_config(config_util.load_user_config(dataset))
print("ACCEPTED", args.blocks_to_swap, args.network_module, args.fp8_base)
"""


@pytest.mark.skipif(SD_SCRIPTS is None or SD_PYTHON is None, reason=SD_SCRIPTS_SKIP)
def test_sd_scripts_own_parser_accepts_the_flux_config_local_only(tmp_path: Path) -> None:
    plan = flux_plan(gpu_from_spec(lookup_gpu("RTX 4070")))
    config_path, dataset_path = write_plan_files(plan, tmp_path)
    done = subprocess.run([str(SD_PYTHON), "-c", SD_CHECK, str(SD_SCRIPTS), str(config_path), str(dataset_path)],
                          capture_output=True, text=True, timeout=300, cwd=str(SD_SCRIPTS))
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"ACCEPTED {plan.settings.blocks_to_swap} networks.lora_flux True" in done.stdout


@pytest.mark.long
def test_gpu_validate_dry_run_plans_every_dit_family_and_steps_the_tiny_twins(tmp_path: Path) -> None:
    """bench/gpu_validate.py --dry-run: each transformer family planned on emulated 8 and 24 GB cards, and the
    GPU case code run for real on the CPU with the tiny twins of the families our engine trains."""
    import json
    import os
    import sys

    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_validate.py"), "--dry-run", str(tmp_path),
                           "--families", "", "--dit-tiers", "8,24"], cwd=ROOT,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "summary.json").read_text(encoding="utf-8"))["cases"]
    cases = [row for row in rows if "case" not in row]
    offloaded = {row["family"]: row for row in rows if row.get("case") == "cpu_offload_checkpointing"}
    families = ["flux-dev", "chroma", "sd3.5-medium", "sd3.5-large", "lumina2", "hunyuan-image-2.1", "anima"]
    assert [(c["family"], c["tier_gb"]) for c in cases] == [(f, t) for f in families for t in (8, 24)]
    skipped = [c for c in cases if "skipped" in c]  # HunyuanImage from 1280 px (CUDA's fp32 norms) needs > 8 GB
    assert [(c["family"], c["tier_gb"]) for c in skipped] == [("hunyuan-image-2.1", 8)]
    assert "needs 9.7 GiB" in skipped[0]["skipped"]
    cases = [c for c in cases if "skipped" not in c]
    assert all(c["dry_run"] and c["predicted_peak_bytes"] <= c["usable_bytes"] for c in cases)
    flux = {c["tier_gb"]: c for c in cases if c["family"] == "flux-dev"}
    assert flux[8]["blocks_to_swap"] > flux[24]["blocks_to_swap"] == 0
    stepped = [c["dry_run_tiny"] for c in cases if c["family"] in families[:4]]
    assert len(stepped) == 8 and all(t["timed_micro_steps"] == 2 and not t["oom"] for t in stepped)
    assert {t["family"] for t in stepped} == {"tiny-flux", "tiny-chroma", "tiny-sd3"}
    assert "blocks_to_swap" in done.stdout and (tmp_path / "sd3.5-large_8gb.json").is_file()
    # the layout check: SDXL's tiny twin stepped contiguous and channels_last; the rule's CPU answer is contiguous
    (layout,) = [row for row in rows if row.get("case") == "layout"]
    assert layout["family"] == "sdxl" and layout["rule"] is False and "rule_right" in layout
    assert [layout[k]["channels_last"] for k in ("contiguous", "channels_last")] == [False, True]
    # at least the 2 asked for, in whole optimizer steps of the 24 GB plan's accumulation
    assert all(layout[k]["timed_micro_steps"] >= 2 and not layout[k]["oom"] for k in ("contiguous", "channels_last"))
    # the 24 GB plans that checkpoint without swapping, once more with cpu_offload_checkpointing: less VRAM
    assert "flux-dev" in offloaded and all(row["tier_gb"] == 24 for row in offloaded.values())
    for family, row in offloaded.items():
        planned = next(c for c in cases if c["family"] == family and c["tier_gb"] == 24)
        assert row["predicted_peak_bytes"] < planned["predicted_peak_bytes"], family


def _sparse_flux_file(path: Path) -> Path:
    """A FLUX.1-dev transformer file in BFL names with its real header (shapes) and zero-filled, sparse data:
    what detection reads is the header, and a sparse file costs no disk."""
    import json
    import struct

    shapes = {"img_in.weight": [3072, 64], "txt_in.weight": [3072, 4096], "guidance_in.in_layer.weight": [3072, 256]}
    shapes.update({f"double_blocks.{i}.img_attn.norm.key_norm.scale": [128] for i in range(19)})
    shapes.update({f"single_blocks.{i}.norm.key_norm.scale": [128] for i in range(38)})
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    with path.open("wb") as fh:
        fh.write(struct.pack("<Q", len(text)) + text)
        fh.truncate(8 + len(text) + offset)
    return path


def test_a_flux_file_path_plans_as_flux_dev(tmp_path: Path) -> None:
    model = _sparse_flux_file(tmp_path / "flux1-dev.safetensors")
    plan = plan_training(PlanRequest(dataset_dir=None, model=str(model), gpus=(gpu_from_spec(lookup_gpu("RTX 4070")),),
                                     cpu_physical_cores=8))
    assert plan.fits and plan.family.name == "flux-dev" and plan.settings.blocks_to_swap > 0
    assert plan.kohya_values()["pretrained_model_name_or_path"] == str(model)


def test_tiny_flux_plans_on_the_cpu_with_its_own_calibration() -> None:
    plan = plan_training(PlanRequest(dataset_dir=None, model="builtin:tiny-flux", cpu_physical_cores=2))
    assert plan.fits and plan.family.name == "tiny-flux" and plan.settings.blocks_to_swap == 0
    assert plan.kohya_values()["network_module"] == "networks.lora_flux"


def test_file_keys_the_user_did_not_give_are_marked_to_fill_in_and_a_builtin_says_what_sd_scripts_needs(tmp_path):
    """A FLUX file without --clip_l / --t5xxl / --ae: their keys are written with placeholder paths that the plan
    marks (``placeholder``, "fill in" in each reason and a line in the text); a given file is not; a built-in
    (whose parts are built in) says which files sd-scripts would take."""
    def plan(model, files=()):
        return plan_training(PlanRequest(dataset_dir=None, model=model, family=get_family("flux-dev"),
                                         gpus=(gpu_from_vram(16),), cpu_physical_cores=8, model_files=files))

    given = tmp_path / "my_ae.safetensors"
    planned = plan(str(tmp_path / "flux1-dev.safetensors"), files=(("ae", str(given)),))
    marked = {c.key: c for c in planned.choices if c.key in ("clip_l", "t5xxl", "ae")}
    assert marked["clip_l"].placeholder and marked["t5xxl"].placeholder and not marked["ae"].placeholder
    assert marked["clip_l"].reason.startswith("fill in your file (or plan with --clip_l FILE)")
    assert marked["ae"].value == str(given) and marked["ae"].reason == "the file you gave"
    assert {c["key"] for c in planned.to_dict()["choices"] if c["placeholder"]} == {"clip_l", "t5xxl"}
    config = toml.loads(write_plan_files(planned, tmp_path / "out")[0].read_text(encoding="utf-8"))
    assert config["clip_l"] == marked["clip_l"].value and config["ae"] == str(given)
    builtin = plan("builtin:flux-dev")
    (note,) = [c for c in builtin.choices if c.key == "model_files"]
    assert not note.kohya and "--model FILE --clip_l FILE --t5xxl FILE --ae FILE" in note.reason
