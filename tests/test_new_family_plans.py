"""Plans for the families sd-scripts trains and our engine does not (yet): SD3.5 Medium / Large, Chroma, Lumina 2,
HunyuanImage-2.1, Anima. Each plan swaps the fewest blocks that fit, puts the family's fp8 under its own key (or
none), writes only options its own sd-scripts script takes (the option tables, with kinds and choices), and
names that script; our engine refuses these families with one line naming --engine sd-scripts; single-file
headers (as kohya's model code names the modules) tell the families apart."""

from __future__ import annotations

import csv
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import toml
from fixtures.held_out import check_held_out_traces
from fixtures.local import REFERENCE, SD_SCRIPTS_SKIP
from fixtures.local import sd_scripts as local_sd_scripts

from autotune.planning.planner import PlanRequest, Preferences, gpu_from_vram, plan_training
from autotune.planning.search import Predictor
from autotune.planning.toml_writer import write_plan_files
from autotune.recovery.ladder import LadderLimits
from sd_scripts_compat.facts.families import get_family
from sd_scripts_compat.models.detect import detect_family

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("sd3.5-medium", "sd3.5-large", "chroma", "lumina2", "hunyuan-image-2.1", "anima")
TIERS = (8, 12, 16, 24)
SD_SCRIPTS, SD_PYTHON = local_sd_scripts()
KINDS = {"store_true": bool, "int": int, "float": float, "str": str, "Path": str, "str[nargs=*]": list,
         "float[nargs=*]": list, "int_or_float": (int, float)}


def plan(family: str, tier: int, **prefs):
    return plan_training(PlanRequest(dataset_dir=None, model=f"./models/{family}.safetensors",
                                     family=get_family(family),
                                     gpus=(gpu_from_vram(tier),), cpu_physical_cores=8,
                                     preferences=Preferences(**prefs)))


def option_table(script: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    """The script's options (the shipped copy; the reference table when present must be the same one)."""
    shipped = ROOT / "sd_scripts_compat" / "data" / f"kohya_{script}_args.tsv"
    with shipped.open(encoding="utf-8") as fh:
        rows = {r["name"]: (r["kind"], tuple(filter(None, r["choices"].split("|"))))
                for r in csv.DictReader(fh, delimiter="\t")}
    reference = REFERENCE / "kohya" / f"{script}_args.tsv"
    if reference.is_file():
        with reference.open(encoding="utf-8") as fh:
            assert {r["name"] for r in csv.DictReader(fh, delimiter="\t")} == set(rows)
    return rows


@pytest.mark.parametrize("family", FAMILIES)
def test_memory_model_matches_full_size_traces_the_fit_did_not_use(family: str) -> None:
    """bench/calibrate_dit_memory.py's held-out traces of the family's own transformer: within 10 %, never more
    than 2 % low; swap counts up to the family's maximum among them."""
    check_held_out_traces(family)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_tier_swaps_the_fewest_blocks_that_fit(family: str) -> None:
    spec = get_family(family)
    plans = {tier: plan(family, tier) for tier in TIERS}
    assert plans[24].fits, plans[24].message
    fitting = [t for t in TIERS if plans[t].fits]
    assert fitting == sorted(fitting) and fitting[-1] == 24  # more VRAM never stops fitting
    swaps = [plans[t].settings.blocks_to_swap for t in fitting]
    assert swaps == sorted(swaps, reverse=True) and max(swaps) <= spec.max_blocks_to_swap
    for tier in fitting:
        p, gpu = plans[tier], gpu_from_vram(tier)
        s = p.settings
        assert p.prediction.peak_bytes <= gpu.usable_bytes and p.prediction.it_per_s > 0
        assert p.launch_command[-3] == spec.kohya_script
        if s.blocks_to_swap:  # one block fewer fits at no micro-batch or checkpointing setting
            predictor = Predictor(spec, (gpu,), 8, t5_fp8="fp8" in str(p.kohya_values().get("t5xxl", ""))
                                  or "fp8_vl" in p.kohya_values(), te_cpu="text_encoder_cpu" in p.kohya_values())
            fewer = replace(s, blocks_to_swap=s.blocks_to_swap - 1)
            for mb in (1, 2):
                for gc in (False, True):
                    assert predictor.predict(replace(fewer, train_batch_size=mb, gradient_checkpointing=gc)) \
                        .required > gpu.usable_bytes, (family, tier, mb, gc)
            assert "fewest swapped blocks" in {c.key: c.reason for c in p.choices}["blocks_to_swap"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tier", (8, 24))
def test_written_config_holds_only_its_scripts_options(tmp_path: Path, family: str, tier: int) -> None:
    p = plan(family, tier)
    if not p.fits:
        pytest.skip(f"{family} does not fit {tier} GB: {p.message}")
    spec = get_family(family)
    config_path, dataset_path = write_plan_files(p, tmp_path)
    table = option_table(spec.kohya_script.removesuffix(".py"))
    values = toml.load(config_path)
    for key, value in values.items():
        assert key in table, f"{key} is not a {spec.kohya_script} option"
        kind, choices = table[key]
        assert isinstance(value, KINDS[kind]) and (kind == "store_true" or not isinstance(value, bool)), (key, value)
        assert not choices or str(value) in choices, (key, value, choices)
    assert values["network_module"] == spec.network_module
    step = toml.load(dataset_path)["datasets"][0]["bucket_reso_steps"]
    assert step % (16 if family in ("lumina2", "anima") else 32) == 0  # what each script asserts


def test_family_rules_reach_the_config() -> None:
    chroma = plan("chroma", 24).kohya_values()
    assert chroma["model_type"] == "chroma" and chroma["guidance_scale"] == 0.0 and chroma["apply_t5_attn_mask"]
    assert "clip_l" not in chroma and {"t5xxl", "ae"} <= set(chroma)
    sd3 = {tier: plan("sd3.5-large", tier) for tier in (8, 24)}
    assert {"clip_l", "clip_g", "t5xxl"} <= set(sd3[24].kohya_values())
    small = sd3[8].kohya_values()  # an fp8 T5-XXL file only helps under fp8_base (sd-scripts upcasts it else)
    assert "fp8" not in small["t5xxl"] or small["fp8_base"]
    for tier in (10, 12, 16, 24):  # HunyuanImage: fp8_scaled, never fp8_base; fp8_vl / the CPU to cache (small cards)
        values = plan("hunyuan-image-2.1", tier).kohya_values()
        assert "fp8_base" not in values and {"text_encoder", "byt5", "vae"} <= set(values)
    hunyuan = {tier: plan("hunyuan-image-2.1", tier).kohya_values() for tier in (10, 16, 24)}
    assert hunyuan[10].get("text_encoder_cpu") and hunyuan[16].get("fp8_vl") and "fp8_vl" not in hunyuan[24]
    # under CUDA's autocast its fp32 norms double a checkpointed block's activations: from 1280 px (the planner's
    # floor, 5/8 of 2048) it needs more than 8 GB; sd-scripts' 8 GB recipe (fp8_scaled, 37 blocks) names no size
    small = plan("hunyuan-image-2.1", 8)
    assert not small.fits and "1280 px" in small.message and "use a card with at least 10 GB" in small.message
    for tier in TIERS:  # Anima's script forces fp8 off: no plan asks for it
        values = plan("anima", tier).kohya_values()
        assert not any(k.startswith("fp8") for k in values) and values["network_train_unet_only"]


def test_ladder_swaps_up_to_each_familys_maximum_and_skips_fp8_where_the_script_has_none() -> None:
    for family in FAMILIES:
        spec = get_family(family)
        limits = LadderLimits.for_family(spec, budget_mib=8000.0, fp8_supported=True, te_cache_allowed=True)
        assert limits.max_blocks_to_swap == spec.max_blocks_to_swap
        assert limits.keys == spec.config_keys
    assert get_family("anima").fp8_option is None and get_family("hunyuan-image-2.1").fp8_option == "fp8_scaled"


def _header_file(path: Path, keys: list[str]) -> Path:
    import torch
    from safetensors.torch import save_file

    save_file({key: torch.zeros(1) for key in keys}, str(path))
    return path


# module names as kohya's model code (library/sd3_models.py, lumina_models.py, hunyuan_image_models.py,
# anima_models.py) and the official files spell them; block counts from the reference stats
HEADERS = {
    "sd3.5-large": ["model.diffusion_model.x_embedder.proj.weight", "model.diffusion_model.context_embedder.weight",
                    *(f"model.diffusion_model.joint_blocks.{i}.x_block.attn.qkv.weight" for i in range(38))],
    "sd3.5-medium": ["x_embedder.proj.weight", "context_embedder.weight",
                     *(f"joint_blocks.{i}.x_block.attn.qkv.weight" for i in range(24)),
                     *(f"joint_blocks.{i}.x_block.attn2.qkv.weight" for i in range(13))],
    "lumina2": ["x_embedder.weight", "cap_embedder.1.weight", "noise_refiner.0.attention.qkv.weight",
                "context_refiner.0.attention.qkv.weight", *(f"layers.{i}.attention.qkv.weight" for i in range(26))],
    "hunyuan-image-2.1": ["img_in.proj.weight", "byt5_in.fc1.weight",
                          "txt_in.individual_token_refiner.blocks.0.self_attn_qkv.weight",
                          *(f"double_blocks.{i}.img_attn_qkv.weight" for i in range(20)),
                          *(f"single_blocks.{i}.linear1.weight" for i in range(40))],
    "anima": ["net.x_embedder.proj.1.weight", "net.t_embedder.1.linear_1.weight",
              *(f"net.blocks.{i}.self_attn.q_proj.weight" for i in range(28))],
}


@pytest.mark.parametrize("family", sorted(HEADERS))
def test_single_file_headers_name_their_family(tmp_path: Path, family: str) -> None:
    path = _header_file(tmp_path / f"{family}.safetensors", HEADERS[family])
    assert detect_family(path).name == family
    assert detect_family(path, family).name == family


def test_untrained_families_are_one_line_from_our_engine(tmp_path: Path) -> None:
    """`autotune run` with our engine, and our engine's own entry point, refuse before anything is written."""
    data = ROOT / "examples" / "dataset"
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "autotune", "run", str(data), "--model", "builtin:lumina2",
                           "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode != 0 and done.stderr.strip().count("\n") == 0, done.stderr
    assert "lumina_train_network.py" in done.stderr and "--engine sd-scripts" in done.stderr
    assert not out.exists()
    config = tmp_path / "c.toml"
    config.write_text('pretrained_model_name_or_path = "builtin:anima"\noutput_dir = "o"\n')
    engine = subprocess.run([sys.executable, "-m", "sd_scripts_compat.train_network", "--config_file", str(config)],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert engine.returncode != 0 and engine.stderr.strip().count("\n") == 0, engine.stderr
    assert "anima_train_network.py" in engine.stderr and not (tmp_path / "o").exists()


@pytest.mark.parametrize("family", FAMILIES)
def test_committed_templates_hold_only_their_scripts_options(family: str) -> None:
    """templates/<family>/<tier>gb/ (8, 10, 12, 16, 24 GB; tests/test_templates.py checks they are fresh)."""
    spec = get_family(family)
    table = option_table(spec.kohya_script.removesuffix(".py"))
    configs = sorted((ROOT / "templates" / family).glob("*gb/config.toml"))
    assert (ROOT / "templates" / family / "24gb" / "config.toml") in configs
    for config in configs:
        assert set(toml.load(config)) <= set(table), config


SD_CHECK = """
import importlib, sys, toml
sys.path.insert(0, sys.argv[1])
script, config, dataset = sys.argv[2], sys.argv[3], sys.argv[4]
sys.argv = [script + ".py", "--config_file", config]
module = importlib.import_module(script)
from library import config_util, train_util
parser = module.setup_parser()
args = train_util.read_config_from_file(parser.parse_args(), parser)
known = {a.dest for a in parser._actions}
unknown = [k for k in toml.load(config) if k not in known]
assert not unknown, unknown
config_util.ConfigSanitizer(True, False, False, True).sanitize_user_config(config_util.load_user_config(dataset))
print("ACCEPTED", args.network_module, args.blocks_to_swap, "deepspeed", args.deepspeed, args.zero_stage)
"""


@pytest.mark.skipif(SD_SCRIPTS is None or SD_PYTHON is None, reason=SD_SCRIPTS_SKIP)
@pytest.mark.parametrize("family", FAMILIES)
def test_sd_scripts_own_parser_accepts_every_template_local_only(family: str) -> None:
    """sd-scripts' own parser of the family's script reads each committed template (config and dataset)."""
    spec = get_family(family)
    for config in sorted((ROOT / "templates" / family).glob("*gb/config.toml")):
        done = subprocess.run([str(SD_PYTHON), "-c", SD_CHECK, str(SD_SCRIPTS), spec.kohya_script.removesuffix(".py"),
                               str(config), str(config.parent / "dataset.toml")], capture_output=True, text=True,
                              timeout=600, cwd=str(config.parent))
        assert done.returncode == 0, (config, done.stderr[-2000:])
        assert f"ACCEPTED {spec.network_module}" in done.stdout, done.stdout


@pytest.mark.skipif(SD_SCRIPTS is None or SD_PYTHON is None, reason=SD_SCRIPTS_SKIP)
def test_sd_scripts_own_parser_reads_the_state_split_as_deepspeed_stage_2_local_only(tmp_path: Path) -> None:
    """The 2 x RTX 3060 plan of Lumina 2 (AdamW, rank 128; the state split) as written, read by sd-scripts' own
    parser of lumina_train_network.py: --deepspeed on, --zero_stage 2."""
    config, dataset = write_plan_files(_named_cards("lumina2", "RTX 3060", 2, optimizer="AdamW", rank=128), tmp_path)
    done = subprocess.run([str(SD_PYTHON), "-c", SD_CHECK, str(SD_SCRIPTS), "lumina_train_network", str(config),
                           str(dataset)], capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ACCEPTED networks.lora_lumina None deepspeed True 2" in done.stdout, done.stdout  # no blocks swapped


def test_wizard_offers_the_sd_scripts_engine_for_a_family_our_engine_does_not_train(tmp_path: Path) -> None:
    out = tmp_path / "wizard"
    done = subprocess.run([sys.executable, "-m", "autotune", "wizard", str(ROOT / "examples" / "dataset"), "--model",
                           "builtin:anima", "--out", str(out), "--yes"], capture_output=True, text=True, timeout=300,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "COLUMNS": "300"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "anima_train_network.py --config_file" in done.stdout and "--engine sd-scripts=PATH" in done.stdout
    assert "Start training now" not in done.stdout  # it would start our engine, which refuses Anima
    assert toml.load(out / "config.toml")["network_module"] == "networks.lora_anima"


def _named_cards(family: str, card: str, count: int, **prefs):
    from autotune.hardware.gpu_catalog import lookup_gpu
    from autotune.planning.planner import gpu_from_spec

    gpus = tuple(gpu_from_spec(lookup_gpu(card)) for _ in range(count))
    return plan_training(PlanRequest(dataset_dir=None, model=f"./models/{family}.safetensors",
                                     family=get_family(family), gpus=gpus, cpu_physical_cores=16,
                                     preferences=Preferences(resolution=1024, **prefs)))


def test_on_several_cards_sd_scripts_splits_the_state_with_its_deepspeed(tmp_path: Path) -> None:
    """Lumina 2 with AdamW at rank 128 on 2 x RTX 3060 12 GB: kept whole on each card, AdamW's two fp32 moments
    leave room only for AdamW8bit; split across the two cards AdamW fits. sd-scripts splits the state with its
    DeepSpeed at ZeRO stage 2 (its LoRA equal to stage 0's: test_sd_scripts_deepspeed_stage_2_trains_the_same_lora),
    so the config says ``deepspeed`` and ``zero_stage``, options of lumina_train_network.py of their kinds, under
    the same accelerate launch command; read back, the config's settings split the state."""
    from sd_scripts_compat.facts.settings_space import settings_from_values

    p = _named_cards("lumina2", "RTX 3060", 2, optimizer="AdamW", rank=128)
    s = p.settings
    assert p.fits and s.shard_optimizer_state and s.optimizer_type == "AdamW" and s.network_dim == 128
    rows = {c.key: c for c in p.choices}
    assert "shard_optimizer_state" not in rows and rows["deepspeed"].value is True and rows["zero_stage"].value == 2
    assert rows["deepspeed"].reason.startswith(
        "the LoRA's optimizer state split across the 2 cards (0.79 GiB per card;")
    assert "kept whole on each (0.40 GiB per card) it needs optimizer AdamW8bit (8-bit state) to fit" in \
        rows["deepspeed"].reason and "DS_BUILD_OPS=0 pip install deepspeed" in rows["deepspeed"].reason
    assert "stage 3 fails or hangs while sd-scripts loads the model" in rows["zero_stage"].reason
    config_path, _ = write_plan_files(p, tmp_path)
    values = toml.load(config_path)
    table = option_table("lumina_train_network")
    assert values["deepspeed"] is True and table["deepspeed"] == ("store_true", ())
    assert values["zero_stage"] == 2 and table["zero_stage"] == ("int", ("0", "1", "2", "3"))
    assert "shard_optimizer_state" not in values and settings_from_values(values).shard_optimizer_state
    assert p.launch_command[:5] == ("accelerate", "launch", "--num_processes", "2", "--multi_gpu")


def test_prodigy_swapped_blocks_and_musubi_tuner_keep_the_state_whole_on_several_cards() -> None:
    """Prodigy's step sums over every parameter (a split state would estimate d per card): whole, said why, no
    DeepSpeed key. With DeepSpeed sd-scripts sets up no block swap (DeepSpeed moves the whole model onto the card):
    HunyuanImage-2.1 on 2 x RTX 4090, which fits only with blocks swapped, keeps the state whole and says what the
    split would need. musubi-tuner has no way to split it: no row."""
    hunyuan = _named_cards("hunyuan-image-2.1", "RTX 4090", 2, optimizer="AdamW", rank=128)
    row = {c.key: c for c in hunyuan.choices}["deepspeed"]
    assert hunyuan.settings.blocks_to_swap > 0 and row.value is False and row.reason.startswith(
        "the LoRA's optimizer state kept whole on each card: split across them nothing fits (needs ")
    assert row.reason.endswith("GiB per card at its smallest settings, no blocks swapped)")
    prodigy = _named_cards("lumina2", "RTX 3060", 2, optimizer="Prodigy", rank=128)
    rows = {c.key: c for c in prodigy.choices}
    assert rows["deepspeed"].value is False and "deepspeed" not in prodigy.kohya_values()
    assert "Prodigy's step sums over all of the LoRA's parameters" in rows["deepspeed"].reason
    qwen = _named_cards("qwen-image", "RTX 4090", 2, optimizer="AdamW", rank=128)
    assert not {"deepspeed", "shard_optimizer_state"} & {c.key for c in qwen.choices}
