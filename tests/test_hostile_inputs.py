"""The hostile-input corpus: bad input a new user gives, each through its own process, as the user runs it.

One row per case: a builder that makes the bad input in the test's own folder and returns the command line,
the exit code, and a substring the stderr line must contain. Every case must end with a non-zero exit,
exactly one non-empty line on stderr (progress may go to stdout), no traceback and no library warning
anywhere, and no new file under the test's folder (no partial output: output folders, caches, configs).
Most cases fail before any model loads; the few that need one use builtin:tiny-sd15 at 64 px. The corpus runs in
forked children of a process that imported the libraries once (tests/fixtures/fork_server.py: 5-7 s less per
case); the commands that start engines (``autotune run``, ``train``, ``bench``) start them as real interpreters.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import toml
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
# one thread: on a shared 2-core machine more threads spin against each other (a step gets 50x slower)
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
TINY = "builtin:tiny-sd15"
FAKE_SD_SCRIPTS = REPO / "tests" / "fixtures" / "fake_sd_scripts" / "sd-scripts"  # a checkout --engine accepts
USER_ERROR = 2

Builder = Callable[[Path], list[str]]
# what a library's warning looks like: Python's warnings ("x.py:12: FutureWarning: ..."), logging's WARNING
LIBRARY_WARNING = re.compile(r"\w+Warning: |warnings\.warn\(|^WARNING|\[W[0-9 ]", re.MULTILINE)


@dataclass(frozen=True)
class Case:
    id: str
    build: Builder  # makes the bad input under the folder it is given; returns the argv after `python -m`
    needle: str  # in the one stderr line
    code: int = USER_ERROR


# ---------------------------------------------------------------- building blocks


def dataset(root: Path, images: int = 2, size: int = 64, folder: str = "2_toy") -> Path:
    sub = root / "data" / folder
    sub.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(images):
        Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(sub / f"img{i}.png")
        (sub / f"img{i}.txt").write_text(f"toy, picture {i}", encoding="utf-8")
    return root / "data"


def config(root: Path, name: str = "config.toml", **overrides: object) -> Path:
    values: dict[str, object] = {
        "pretrained_model_name_or_path": TINY,
        "train_data_dir": None if "train_data_dir" in overrides else str(dataset(root)),
        "output_dir": str(root / "out"), "output_name": "lora", "resolution": "64,64", "caption_extension": ".txt",
        "train_batch_size": 1, "max_train_steps": 2, "network_dim": 4, "network_alpha": 4, "learning_rate": 1e-3,
        "max_data_loader_n_workers": 0,
    }
    values.update(overrides)
    values = {k: v for k, v in values.items() if v is not None}
    path = root / name
    path.write_text(toml.dumps(values), encoding="utf-8")
    return path


def engine(root: Path, *extra: str, **overrides: object) -> list[str]:
    return ["sd_scripts_compat.train_network", "--config_file", str(config(root, **overrides)), *extra]


def train(root: Path, *extra: str, **overrides: object) -> list[str]:
    return ["autotune", "train", str(config(root, **overrides)), *extra]


def plan(root: Path, *extra: str, model: str = TINY) -> list[str]:
    return ["autotune", "plan", str(dataset(root)), "--model", model, *extra]


def run(root: Path, *extra: str, model: str = TINY) -> list[str]:
    return ["autotune", "run", str(dataset(root)), "--model", model, "--out", str(root / "run"), *extra]


def musubi_checkout(root: Path) -> Path:
    """A folder laid out as a musubi-tuner checkout with Wan's training script (empty: nothing runs it here)."""
    scripts = root / "musubi" / "src" / "musubi_tuner"
    scripts.mkdir(parents=True, exist_ok=True)
    (scripts / "wan_train_network.py").write_text("")
    return root / "musubi"


def wan22_dit(root: Path) -> Path:
    """A Wan 2.2 A14B DiT file's layout (its module names, 2x2 zero weights): detected, never trained."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_musubi_detect import write_dit

    return write_dit(root / "wan2.2_t2v_low_noise_14B_fp16.safetensors", "wan2.2-t2v-a14b")


def text_file(path: Path, text: str = "this is not a tensor file\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def safetensors_file(path: Path, tensors: dict[str, np.ndarray], truncate: bool = False) -> Path:
    from safetensors.numpy import save

    data = save(tensors)
    path.write_bytes(data[: len(data) // 2] if truncate else data)
    return path


def lora_like(path: Path, truncate: bool = False) -> Path:
    """A small kohya-format LoRA (keys and shapes only matter to the readers that reject it)."""
    down, up = np.zeros((4, 320), np.float32), np.zeros((320, 4), np.float32)
    return safetensors_file(path, {"lora_unet_x.lora_down.weight": down, "lora_unet_x.lora_up.weight": up,
                                   "lora_unet_x.alpha": np.array(4.0, np.float32)}, truncate)


def utf16(path: Path) -> Path:
    path.write_bytes(f'pretrained_model_name_or_path = "{TINY}"\n'.encode("utf-16"))
    return path


def binary(path: Path) -> Path:
    path.write_bytes(bytes(range(256)) * 8)
    return path


def symlink_loop(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "loop_a").symlink_to(root / "loop_b")
    (root / "loop_b").symlink_to(root / "loop_a")
    return root / "loop_a"


def png_claiming(path: Path, width: int, height: int) -> Path:
    """A 100-byte PNG whose header claims width x height (IHDR rewritten, CRC fixed)."""
    buffer = io.BytesIO()
    Image.new("1", (8, 8)).save(buffer, format="PNG")
    data = bytearray(buffer.getvalue())
    data[16:24] = width.to_bytes(4, "big") + height.to_bytes(4, "big")
    data[29:33] = zlib.crc32(bytes(data[12:29])).to_bytes(4, "big")
    path.write_bytes(bytes(data))
    return path


def with_image(root: Path, make: Callable[[Path], object]) -> Path:
    """A dataset whose second image is made by ``make`` (a hostile file among good ones)."""
    data = dataset(root)
    make(data / "2_toy" / "img1.png")
    return data


def truncated_jpeg(root: Path) -> Path:
    data = dataset(root)
    (data / "2_toy" / "img1.png").unlink()
    rng = np.random.default_rng(1)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (96, 96, 3), dtype=np.uint8)).save(buffer, format="JPEG")
    (data / "2_toy" / "img1.jpg").write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    return data


def state_folder(root: Path, *, broken: bool) -> Path:
    folder = root / "old" / "lora-state"
    folder.mkdir(parents=True)
    (folder / "train_state.json").write_text('{"format": "lora-autotune-state/1", "counters": {' if broken else "{}")
    if broken:
        lora_like(folder / "tensors.safetensors", truncate=True)
    return folder


def run_with_saved_state(root: Path, text: str) -> list[str]:
    """An --out whose autotune_run.json (the supervisor's own state) is ``text``, next to a good config.toml."""
    out = root / "run"
    out.mkdir(parents=True)
    (out / "state").mkdir()
    (out / "state/autotune_run.json").write_text(text, encoding="utf-8")
    config(out, output_dir=str(out / "output"))
    return ["autotune", "run", str(dataset(root)), "--model", TINY, "--out", str(out), "--resume"]


def a_file(path: Path) -> Path:
    return text_file(path, "a regular file\n")


BAD_DATA = 65  # contract.BAD_DATA_EXIT_CODE: NaN / Inf in an input file, not a divergence


def quantized_model(path: Path) -> Path:
    """A checkpoint whose UNet weights are int8 (a quantized file), its CLIP position ids int64 as usual."""
    return safetensors_file(path, {"model.diffusion_model.input_blocks.0.0.weight": np.zeros((320, 4, 3, 3), np.int8),
                                   "cond_stage_model.transformer.text_model.embeddings.position_ids":
                                       np.arange(77, dtype=np.int64)[None]})


def tiny_model_with(path: Path, poison: str, value: float = float("nan")) -> Path:
    """builtin:tiny-sd15 as a single file, with one value of the first tensor whose name contains ``poison``."""
    from safetensors.torch import load_file, save_file

    from sd_scripts_compat.facts.families import get_family
    from sd_scripts_compat.models.build import build_modules
    from sd_scripts_compat.models.single_file import save_single_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_single_file(build_modules(get_family("tiny-sd15")), path)
    tensors = load_file(str(path))
    name = next(k for k in sorted(tensors) if poison in k and tensors[k].is_floating_point())
    tensors[name].view(-1)[tensors[name].numel() // 2] = value
    save_file(tensors, str(path))
    return path


def lora_with(path: Path, value: float) -> Path:
    """A LoRA for builtin:tiny-sd15 (made by training nothing: a fresh network's weights) with one bad value."""
    from safetensors.torch import save_file

    from sd_scripts_compat.network.lora import create_network
    from sd_scripts_compat.runtimes import load_base_model

    network = create_network(load_base_model(TINY), network_dim=4, network_alpha=4.0)
    state = {k: v.detach().clone().contiguous() for k, v in network.state_dict().items()}
    first = next(k for k in sorted(state) if k.endswith("lora_up.weight"))
    state[first].view(-1)[0] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path))
    return path


# ---------------------------------------------------------------- the corpus

CLI = [
    Case("plan-strict-pin-forces-rank-down", lambda t: plan(t, "--vram", "8", "--batch", "4", "--strict",
                                                          model="builtin:sdxl"), "--strict: your micro-batch 4 x 1"),
    Case("wizard-accum-zero", lambda t: ["autotune", "wizard", str(dataset(t)), "--model", TINY, "--cpu", "--accum",
                                         "0", "--yes"], "--accum 0"),
    Case("plan-epochs-negative", lambda t: plan(t, "--epochs", "-1"), "--epochs -1"),
    Case("plan-epochs-zero", lambda t: plan(t, "--epochs", "0"), "--epochs 0"),
    Case("plan-rank-zero", lambda t: plan(t, "--rank", "0"), "--rank 0"),
    Case("plan-output-name-with-a-path", lambda t: plan(t, "--output-name", "../evil", "--out", str(t / "p")),
         "'../evil': letters, digits"),
    Case("run-output-name-with-a-separator", lambda t: run(t, "--output-name", "a/b"), "'a/b': letters, digits"),
    Case("plan-save-every-zero-epochs", lambda t: plan(t, "--save_every_n_epochs", "0"), "must be 1 or more, got 0"),
    Case("plan-seed-negative", lambda t: plan(t, "--seed", "-1"), "argument --seed: must be 0 or more, got -1"),
    Case("plan-noise-offset-nan", lambda t: plan(t, "--noise_offset", "nan"), "--noise_offset/--noise-offset"),
    Case("plan-unknown-scheduler", lambda t: plan(t, "--lr_scheduler", "bogus"), "invalid choice: 'bogus'"),
    Case("run-sample-prompts-missing", lambda t: run(t, "--sample_prompts", str(t / "nope.txt")),
         "nope.txt: no such file; give a text file of prompts"),
    Case("plan-resolution-off-step", lambda t: plan(t, "--resolution", "70"), "--resolution 70"),
    Case("plan-resolution-below-floor", lambda t: plan(t, "--resolution", "8"), "--resolution 8"),
    Case("plan-resolution-huge", lambda t: plan(t, "--resolution", "65536"), "--resolution 65536"),
    Case("plan-frames-on-an-image-family", lambda t: plan(t, "--frames", "17"), "--frames 17"),
    Case("plan-frames-not-1-plus-4k", lambda t: plan(t, "--frames", "16", model="builtin:wan2.1-t2v-1.3b"),
         "--frames 16"),
    Case("run-musubi-family", lambda t: run(t, model="builtin:z-image"), "musubi-tuner"),
    Case("run-musubi-engine-builtin-model", lambda t: run(t, "--engine", f"musubi-tuner={t}", model="builtin:z-image"),
         "DiT file"),
    Case("run-musubi-engine-on-sd15", lambda t: run(t, "--engine", f"musubi-tuner={t}"), "not trained by musubi"),
    Case("run-musubi-engine-with-config", lambda t: run(t, "--engine", f"musubi-tuner={t}", "--config",
                                                           str(text_file(t / "c.toml", "network_dim = 4\n")),
                                                           model="builtin:z-image"), "--config"),
    Case("plan-clips-from-a-folder-of-images",
         lambda t: plan(t, "--frames", "33", model="builtin:wan2.1-t2v-1.3b"), "holds no videos"),
    Case("plan-frames-zero", lambda t: plan(t, "--frames", "0", model="builtin:wan2.1-t2v-1.3b"), "--frames 0"),
    Case("plan-both-experts-of-a-one-dit-family", lambda t: plan(t, "--experts", "both", model="builtin:qwen-image"),
         "has one DiT"),
    Case("plan-low-expert-with-the-high-noise-file",
         lambda t: plan(t, "--experts", "low", "--dit_high_noise", str(text_file(t / "high.safetensors", "x")),
                        model="builtin:wan2.2-t2v-a14b"), "--experts low with --dit_high_noise"),
    Case("run-musubi-both-experts-without-the-high-noise-file",
         lambda t: run(t, "--experts", "both", "--vram", "24", "--engine", f"musubi-tuner={musubi_checkout(t)}",
                       "--vae", str(text_file(t / "vae.safetensors")), "--t5", str(text_file(t / "t5.pth")),
                       model=str(wan22_dit(t))), "give it with --dit_high_noise FILE"),
    Case("plan-resolution-sd15-500", lambda t: plan(t, "--resolution", "500", model="builtin:sd15"),
         "--resolution 500"),
    Case("plan-vram-zero", lambda t: plan(t, "--vram", "0"), "--vram 0"),
    Case("plan-vram-nan", lambda t: plan(t, "--vram", "nan"), "--vram"),
    Case("plan-ram-inf", lambda t: plan(t, "--ram", "inf"), "--ram"),
    Case("run-memory-limit-inf", lambda t: run(t, "--memory-limit", "inf"), "--memory-limit"),
    Case("run-stall-timeout-nan", lambda t: run(t, "--stall-timeout", "nan"), "--stall-timeout"),
    Case("engine-learning-rate-nan", lambda t: engine(t, learning_rate=float("nan")), "learning_rate"),
    Case("engine-max-grad-norm-inf", lambda t: engine(t, max_grad_norm=float("inf")), "max_grad_norm"),
    Case("engine-seed-negative", lambda t: engine(t, seed=-1), "seed"),
    Case("engine-output-name-too-long", lambda t: engine(t, output_name="n" * 240), "output_name"),
    Case("engine-output-dir-component-too-long", lambda t: engine(t, output_dir=str(t / ("d" * 300))), "300 bytes"),
    Case("engine-sample-prompts-component-too-long", lambda t: engine(t, sample_prompts=str(t / ("p" * 256))),
         "256 bytes"),
    Case("engine-optimizer-args-bad-value", lambda t: engine(t, optimizer_args=["betas=(2.0, 0.9)"]),
         "optimizer_args for AdamW"),
    Case("engine-optimizer-args-unknown-key", lambda t: engine(t, optimizer_args=["momentumm=0.9"]), "momentumm"),
    Case("engine-sample-prompts-bad-size", lambda t: engine(t, sample_prompts=str(text_file(
        t / "prompts.txt", "a toy --w wide\n")), sample_every_n_steps=1), "--w"),
    Case("engine-seed-too-big", lambda t: engine(t, seed=2**64), "seed"),
    Case("plan-vram-negative", lambda t: plan(t, "--vram", "-8"), "--vram -8"),
    Case("plan-gpu-unknown", lambda t: plan(t, "--gpu", "Voodoo 9000"), "Voodoo 9000"),
    Case("plan-cpu-cores-zero", lambda t: plan(t, "--cpu-cores", "0"), "--cpu-cores 0"),
    Case("plan-out-under-a-file", lambda t: plan(t, "--out", str(a_file(t / "f") / "plan")), "f"),
    Case("plan-family-unknown", lambda t: plan(t, "--family", "sd9"), "sd9"),
    Case("plan-model-builtin-unknown", lambda t: plan(t, model="builtin:nope"), "builtin:nope"),
    Case("plan-goal-unknown", lambda t: plan(t, "--goal", "portrait"), "portrait"),
    Case("run-stall-timeout-zero", lambda t: run(t, "--stall-timeout", "0"), "--stall-timeout 0"),
    Case("run-stall-timeout-negative", lambda t: run(t, "--stall-timeout", "-5"), "--stall-timeout -5"),
    Case("run-max-retries-negative", lambda t: run(t, "--max-retries", "-1"), "--max-retries -1"),
    Case("run-memory-limit-tiny", lambda t: run(t, "--memory-limit", "1"), "--memory-limit 1"),
    Case("run-emulate-card-negative", lambda t: run(t, "--emulate-card", "-4"), "--emulate-card -4"),
    Case("run-emulate-card-nan", lambda t: run(t, "--emulate-card", "nan"), "--emulate-card"),
    Case("plan-emulate-card-with-vram", lambda t: plan(t, "--emulate-card", "16", "--vram", "8"),
         "drop --gpu / --vram"),
    Case("plan-memory-model-scale-zero", lambda t: plan(t, "--memory-model-scale", "0"), "--memory-model-scale 0"),
    Case("plan-gpus-without-a-card", lambda t: plan(t, "--gpus", "2"), "--gpus N repeats one card"),
    Case("plan-gpus-zero", lambda t: plan(t, "--vram", "12", "--gpus", "0"), "--gpus 0"),
    Case("engine-fsdp-unknown-strategy", lambda t: engine(t, fsdp="zero3"),
         "one of full_shard, shard_grad_op, hybrid_shard"),
    Case("engine-fsdp-groups-one-process", lambda t: engine(t, fsdp="hybrid_shard", fsdp_shard_size=2),
         "sharding needs several processes"),
    Case("engine-fsdp-group-size-without-groups", lambda t: engine(t, fsdp_shard_size=2),
         "fsdp_shard_size = 2: it sizes the groups of fsdp = \"hybrid_shard\""),
    Case("engine-split-state-one-process", lambda t: engine(t, shard_optimizer_state=True),
         "shard_optimizer_state: it splits the optimizer's state across several processes"),
    Case("engine-split-state-not-a-bool", lambda t: engine(t, shard_optimizer_state="yes"),
         "shard_optimizer_state: expected true or false"),
    Case("engine-fsdp-group-size-not-an-integer", lambda t: engine(t, fsdp="hybrid_shard", fsdp_shard_size="two"),
         "fsdp_shard_size: expected an integer, got"),
    Case("engine-fsdp-one-process", lambda t: engine(t, fsdp="full_shard"), "sharding needs several processes"),
    Case("engine-fsdp-not-a-string", lambda t: engine(t, fsdp=True), "fsdp: expected a string"),
    Case("engine-fsdp-offload-without-fsdp", lambda t: engine(t, fsdp_offload_params=True),
         "fsdp_offload_params: it offloads the shares of a sharded denoiser"),
    Case("engine-fsdp-offload-not-a-bool", lambda t: engine(t, fsdp="full_shard", fsdp_offload_params="yes"),
         "fsdp_offload_params"),
    Case("engine-ddp-timeout-zero", lambda t: engine(t, ddp_timeout=0), "ddp_timeout"),
    Case("run-emulate-card-with-sd-scripts", lambda t: run(
        t, "--emulate-card", "16", "--engine", f"sd-scripts={FAKE_SD_SCRIPTS}"), "another trainer counts none"),
    Case("run-save-state-every-zero", lambda t: run(t, "--save-state-every", "0"), "--save-state-every 0"),
    Case("run-epochs-zero", lambda t: run(t, "--epochs", "0"), "--epochs 0"),
    Case("run-resolution-off-step", lambda t: run(t, "--resolution", "70"), "--resolution 70"),
    Case("run-out-under-a-file", lambda t: ["autotune", "run", str(dataset(t)), "--model", TINY, "--out",
                                            str(a_file(t / "f") / "run")], "--out"),
    Case("run-out-is-a-file", lambda t: ["autotune", "run", str(dataset(t)), "--model", TINY, "--out",
                                         str(a_file(t / "f"))], "--out"),
    Case("run-resume-nothing-there", lambda t: run(t, "--resume"), "no interrupted autotune run"),
    Case("run-resume-a-file-in-no-run", lambda t: ["autotune", "run", str(dataset(t)), "--model", TINY, "--resume",
                                                    str(text_file(t / "notes" / "x.txt"))], "not in an autotune run"),
    Case("run-resume-another-run-than-out", lambda t: run(t, "--resume", run_with_saved_state(t / "b", "{}")[-2]),
         "give one of them"),
    Case("run-resume-saved-state-garbage", lambda t: run_with_saved_state(t, "{not json"), "state/autotune_run.json"),
    Case("run-resume-saved-state-other-version", lambda t: run_with_saved_state(t, '{"settings": {"x": 1}}'),
         "another version"),
    Case("inspect-missing", lambda t: ["autotune", "inspect", str(t / "nope.safetensors")], "nope.safetensors"),
    Case("doctor-missing", lambda t: ["autotune", "doctor", str(t / "nope")], "not found"),
    Case("doctor-batch-zero", lambda t: ["autotune", "doctor", str(dataset(t)), "--batch", "0"], "--batch"),
    Case("doctor-config-missing", lambda t: ["autotune", "doctor", str(dataset(t)), "--config", str(t / "nope.toml")],
         "nope.toml"),
    Case("doctor-dataset-config-without-config", lambda t: ["autotune", "doctor", str(dataset(t)),
                                                            "--dataset-config", str(t / "d.toml")], "--config"),
    Case("doctor-resolution-zero", lambda t: ["autotune", "doctor", str(dataset(t)), "--resolution", "0"],
         "--resolution"),
    Case("probe-gpu-unknown", lambda t: ["autotune", "probe", "--gpu", "Voodoo 9000"], "Voodoo 9000"),
    Case("probe-option-unknown", lambda t: ["autotune", "probe", "--gpus", "RTX 3060"], "--gpus"),
    Case("command-unknown", lambda t: ["autotune", "trian"], "trian"),
    Case("plan-no-arguments", lambda t: ["autotune", "plan"], "required"),
    Case("plan-vram-not-a-number", lambda t: plan(t, "--vram", "lots"), "--vram"),
    Case("run-max-retries-not-a-number", lambda t: run(t, "--max-retries", "many"), "--max-retries"),
    Case("engine-steps-not-a-number", lambda t: engine(t, "--max_train_steps", "ten"), "max_train_steps"),
    Case("train-flag-without-value", lambda t: train(t, "--pretrained_model_name_or_path"),
         "pretrained_model_name_or_path"),
    Case("engine-max-train-steps-zero", lambda t: engine(t, max_train_steps=0), "max_train_steps"),
]

CONFIG = [
    Case("train-config-missing", lambda t: ["autotune", "train", str(t / "nope.toml")], "nope.toml"),
    Case("train-config-utf16", lambda t: ["autotune", "train", str(utf16(t / "c.toml"))], "UTF-16"),
    Case("train-config-binary", lambda t: ["autotune", "train", str(binary(t / "c.toml"))], "c.toml"),
    Case("train-config-empty", lambda t: ["autotune", "train", str(text_file(t / "c.toml", ""))],
         "pretrained_model_name_or_path"),
    Case("train-config-malformed", lambda t: ["autotune", "train", str(text_file(t / "c.toml", 'a = "open\n'))],
         "malformed TOML"),
    Case("train-config-a-folder", lambda t: ["autotune", "train", str(dataset(t))], "data"),
    Case("train-key-typo", lambda t: train(t, learning_rat=1e-4), "learning_rate"),
    Case("train-wrong-type-steps", lambda t: train(t, max_train_steps="ten"), "max_train_steps"),
    Case("train-wrong-type-lr", lambda t: train(t, learning_rate="fast"), "learning_rate"),
    Case("train-resolution-garbage", lambda t: train(t, resolution="big"), "resolution"),
    Case("train-network-dim-negative", lambda t: train(t, network_dim=-4), "network_dim"),
    Case("train-batch-size-zero", lambda t: train(t, train_batch_size=0), "train_batch_size"),
    Case("train-output-name-escapes", lambda t: train(t, output_name="../../escaped"), "output_name"),
    Case("train-optimizer-unknown", lambda t: train(t, optimizer_type="SuperAdam"), "SuperAdam"),
    Case("engine-config-utf16", lambda t: ["sd_scripts_compat.train_network", "--config_file",
                                           str(utf16(t / "c.toml"))], "UTF-16"),
    Case("engine-config-binary", lambda t: ["sd_scripts_compat.train_network", "--config_file",
                                            str(binary(t / "c.toml"))], "c.toml"),
    Case("engine-flag-unknown", lambda t: engine(t, "--learning_rat", "1e-4"), "learning_rat"),
    Case("engine-dataset-config-malformed", lambda t: engine(
        t, "--dataset_config", str(text_file(t / "d.toml", "[[datasets]\n")), train_data_dir=None), "d.toml"),
    Case("engine-dataset-config-utf16", lambda t: engine(t, "--dataset_config", str(utf16(t / "d.toml")),
                                                         train_data_dir=None), "UTF-16"),
    Case("engine-dataset-config-missing", lambda t: engine(t, "--dataset_config", str(t / "nope.toml"),
                                                           train_data_dir=None), "nope.toml"),
    Case("engine-dataset-config-no-datasets", lambda t: engine(
        t, "--dataset_config", str(text_file(t / "d.toml", "[general]\nshuffle_caption = true\n")),
        train_data_dir=None), "datasets"),
    Case("engine-dataset-config-subset-missing-dir", lambda t: engine(t, "--dataset_config", str(text_file(
        t / "d.toml", f'[[datasets]]\n[[datasets.subsets]]\nimage_dir = "{t / "nope"}"\n')), train_data_dir=None),
        "nope"),
    Case("run-config-missing", lambda t: run(t, "--config", str(t / "nope.toml")), "nope.toml"),
    Case("run-config-utf16", lambda t: run(t, "--config", str(utf16(t / "c.toml"))), "UTF-16"),
    Case("run-config-binary", lambda t: run(t, "--config", str(binary(t / "c.toml"))), "c.toml"),
    Case("run-config-malformed", lambda t: run(t, "--config", str(text_file(t / "c.toml", "x = \n"))),
         "malformed TOML"),
    Case("run-config-key-typo", lambda t: run(t, "--config", str(config(t, learning_rat=1e-4))), "learning_rate"),
    Case("run-dataset-config-missing", lambda t: run(t, "--config", str(config(t)), "--dataset-config",
                                                     str(t / "nope.toml")), "nope.toml"),
    # config-only rules live in the config reader: `autotune run`'s pre-flight refuses them before any model loads
    Case("run-config-per-encoder-lrs", lambda t: run(t, "--config", str(config(t, text_encoder_lr=[1e-4, 5e-5]))),
         "text_encoder_lr"),
    Case("run-dataset-config-two-datasets", lambda t: run(t, "--config", str(config(t, train_data_dir=None)),
                                                          "--dataset-config", str(two_datasets(t))),
         "2 [[datasets]] given"),
    Case("engine-tiny-flux-swaps-too-many", lambda t: [
        "sd_scripts_compat.flux_train_network", "--config_file",
        str(config(t, pretrained_model_name_or_path="builtin:tiny-flux", blocks_to_swap=3))], "swaps at most 2"),
    Case("run-tiny-flux-config-swaps-too-many", lambda t: run(t, "--config", str(config(
        t, pretrained_model_name_or_path="builtin:tiny-flux", blocks_to_swap=3)), model="builtin:tiny-flux"),
         "swaps at most 2"),
    Case("engine-resolution-off-the-familys-step", lambda t: engine(t, resolution="70,70"),
         "tiny-sd15 trains at multiples of 8 px"),
    Case("plan-flux-resolution-off-its-step", lambda t: plan(t, "--resolution", "72", model="builtin:tiny-flux"),
         "multiples of 16"),
]


def two_datasets(root: Path) -> Path:
    folder = dataset(root)
    path = root / "dataset.toml"
    block = {"resolution": [64, 64], "batch_size": 1, "subsets": [{"image_dir": str(folder / "2_toy")}]}
    path.write_text(toml.dumps({"datasets": [block, block]}), encoding="utf-8")
    return path

DATASETS = [
    Case("plan-dataset-missing", lambda t: ["autotune", "plan", str(t / "nope"), "--model", TINY], "nope"),
    Case("plan-dataset-symlink-loop", lambda t: ["autotune", "plan", str(symlink_loop(t)), "--model", TINY],
         "loop_a"),
    Case("run-dataset-missing", lambda t: ["autotune", "run", str(t / "nope"), "--model", TINY, "--out",
                                           str(t / "run")], "nope"),
    Case("run-dataset-symlink-loop", lambda t: ["autotune", "run", str(symlink_loop(t)), "--model", TINY,
                                                "--out", str(t / "run")], "loop_a"),
    Case("run-dataset-is-a-file", lambda t: ["autotune", "run", str(a_file(t / "f")), "--model", TINY, "--out",
                                             str(t / "run")], "f"),
    Case("run-dataset-empty", lambda t: ["autotune", "run", str((t / "empty").mkdir() or t / "empty"),
                                         "--model", TINY, "--out", str(t / "run")], "holds no images"),
    Case("run-dataset-only-zero-repeats", lambda t: ["autotune", "run", str(dataset(t, folder="0_toy")),
                                                     "--model", TINY, "--out", str(t / "run")], "0 repeats"),
    Case("run-dataset-bomb", lambda t: ["autotune", "run", str(with_image(t, lambda p: png_claiming(p, 30000, 30000))),
                                        "--model", TINY, "--out", str(t / "run")], "img1.png"),
    Case("engine-dataset-missing", lambda t: engine(t, train_data_dir=str(t / "nope")), "nope"),
    Case("engine-dataset-empty", lambda t: engine(t, train_data_dir=str((t / "e").mkdir() or t / "e")), "e"),
    Case("engine-dataset-is-a-file", lambda t: engine(t, train_data_dir=str(a_file(t / "f"))), "f"),
    Case("engine-dataset-symlink-loop", lambda t: engine(t, train_data_dir=str(symlink_loop(t))), "loop_a"),
    Case("engine-image-bomb-20000px", lambda t: engine(t, train_data_dir=str(with_image(
        t, lambda p: Image.new("1", (20000, 20000)).save(p)))), "decompression-bomb"),
    Case("engine-image-claims-30000px", lambda t: engine(t, train_data_dir=str(with_image(
        t, lambda p: png_claiming(p, 30000, 30000)))), "decompression-bomb"),
    Case("engine-image-truncated-jpeg", lambda t: engine(t, train_data_dir=str(truncated_jpeg(t))), "truncated"),
    Case("engine-image-random-bytes", lambda t: engine(t, train_data_dir=str(with_image(
        t, lambda p: p.write_bytes(np.random.default_rng(3).bytes(2000))))), "img1.png"),
    Case("engine-image-empty-file", lambda t: engine(t, train_data_dir=str(with_image(
        t, lambda p: p.write_bytes(b"")))), "img1.png"),
    Case("engine-image-truncated-jpeg-cached", lambda t: engine(
        t, train_data_dir=str(truncated_jpeg(t)), cache_latents=True, cache_latents_to_disk=True), "truncated"),
]

MODELS = [
    Case("train-model-missing", lambda t: train(t, pretrained_model_name_or_path=str(t / "nope.safetensors")),
         "nope.safetensors"),
    Case("train-model-text-as-safetensors", lambda t: train(
        t, pretrained_model_name_or_path=str(text_file(t / "m.safetensors"))), "m.safetensors"),
    Case("train-model-truncated-safetensors", lambda t: train(t, pretrained_model_name_or_path=str(
        safetensors_file(t / "m.safetensors", {"w": np.zeros((64, 64), np.float32)}, truncate=True))),
        "m.safetensors"),
    Case("train-model-is-a-lora", lambda t: train(t, pretrained_model_name_or_path=str(lora_like(
        t / "m.safetensors"))), "m.safetensors"),
    Case("train-model-ckpt-without-allow-pickle", lambda t: train(
        t, pretrained_model_name_or_path=str(a_file(t / "m.ckpt")), v2=None), "--allow_pickle"),
    Case("train-model-folder-without-index", lambda t: train(
        t, pretrained_model_name_or_path=str((t / "m").mkdir() or t / "m")), "model_index.json"),
    Case("plan-model-ckpt-without-allow-pickle", lambda t: plan(t, model=str(a_file(t / "m.ckpt"))), "--allow-pickle"),
    Case("run-model-ckpt-without-allow-pickle", lambda t: run(t, model=str(a_file(t / "m.ckpt"))), "--allow-pickle"),
    Case("engine-network-args-unknown-key", lambda t: engine(t, network_args=["conv_dims=4"]), "conv_dims"),
    Case("engine-network-args-dropout-key", lambda t: engine(t, network_args=["dropout=0.1"]), "network_dropout"),
    Case("engine-network-args-block-dims-count", lambda t: engine(t, network_args=["block_dims=4,4"]),
         "block_dims must have 25 values"),
    Case("engine-network-args-true-lowercase", lambda t: engine(t, network_args=["conv_dim=4", "rank_dropout=x"]),
         "rank_dropout"),
    Case("engine-lycoris-unknown-algo", lambda t: engine(t, network_module="lycoris.kohya",
                                                         network_args=["algo=lokrr"]), "lokrr"),
    Case("run-config-network-args-unimplemented", lambda t: run(t, "--config", str(config(
        t, network_args=["block_alphas=1"]))), "block_alphas"),
    Case("engine-dataset-config-batch-zero", lambda t: engine(t, "--dataset_config", str(text_file(
        t / "d.toml", f'[[datasets]]\nbatch_size = 0\n[[datasets.subsets]]\nimage_dir = "{dataset(t)}"\n')),
        train_data_dir=None),
        "batch_size"),
    Case("engine-dataset-config-keep-tokens-negative", lambda t: engine(t, "--dataset_config", str(text_file(
        t / "d.toml", f'[[datasets]]\nkeep_tokens = -1\n[[datasets.subsets]]\nimage_dir = "{dataset(t)}"\n')),
        train_data_dir=None),
        "keep_tokens"),
    Case("engine-train-data-dir-is-an-n-name-folder", lambda t: engine(
        t, train_data_dir=str(dataset(t) / "2_toy")), "give its parent"),
    Case("run-config-on-an-n-name-folder", lambda t: ["autotune", "run", str(dataset(t) / "2_toy"), "--model", TINY,
                                                      "--config", str(config(t)), "--out", str(t / "run")],
         "pass its parent"),
    Case("engine-model-ckpt-without-allow-pickle", lambda t: engine(
        t, pretrained_model_name_or_path=str(a_file(t / "m.ckpt"))), "--allow_pickle"),
    Case("engine-model-text-as-safetensors", lambda t: engine(
        t, pretrained_model_name_or_path=str(text_file(t / "m.safetensors"))), "m.safetensors"),
    Case("engine-model-unknown-suffix", lambda t: engine(
        t, pretrained_model_name_or_path=str(a_file(t / "m.bin"))), "m.bin"),
    Case("plan-model-ckpt", lambda t: plan(t, "--family", "sd15", model=str(a_file(t / "m.ckpt"))), "autotune plan"),
    Case("run-model-ckpt", lambda t: run(t, "--family", "sd15", model=str(a_file(t / "m.ckpt"))), "autotune run"),
    Case("run-model-ckpt-no-family", lambda t: run(t, model=str(a_file(t / "m.ckpt"))), "convert it"),
    Case("plan-model-missing", lambda t: plan(t, model=str(t / "nope.safetensors")), "nope.safetensors"),
    Case("plan-model-text-as-safetensors", lambda t: plan(t, model=str(text_file(t / "m.safetensors"))),
         "m.safetensors"),
    Case("run-model-is-a-lora", lambda t: run(t, model=str(lora_like(t / "m.safetensors"))), "m.safetensors"),
    # quantized and damaged base models: refused by name, before training (and NaN never called "diverged")
    Case("engine-model-int8", lambda t: engine(t, pretrained_model_name_or_path=str(quantized_model(
        t / "m.safetensors"))), "quantized weights (int8"),
    Case("train-model-int8", lambda t: train(t, pretrained_model_name_or_path=str(quantized_model(
        t / "m.safetensors"))), "quantized weights (int8"),
    Case("plan-model-int8", lambda t: plan(t, model=str(quantized_model(t / "m.safetensors"))), "quantized weights"),
    Case("run-model-int8", lambda t: run(t, model=str(quantized_model(t / "m.safetensors"))), "quantized weights"),
    Case("engine-model-gguf", lambda t: engine(t, pretrained_model_name_or_path=str(binary(t / "m.gguf"))),
         "GGUF-quantized"),
    Case("plan-model-gguf", lambda t: plan(t, model=str(binary(t / "m.gguf"))), "GGUF-quantized"),
    Case("run-model-gguf", lambda t: run(t, model=str(binary(t / "m.gguf"))), "GGUF-quantized"),
    Case("engine-model-nan-unet-weight", lambda t: engine(t, pretrained_model_name_or_path=str(tiny_model_with(
        t / "m.safetensors", "model.diffusion_model."))), "hold NaN or Inf", BAD_DATA),
    Case("engine-model-inf-vae-weight", lambda t: engine(t, pretrained_model_name_or_path=str(tiny_model_with(
        t / "m.safetensors", "first_stage_model.", float("inf")))), "AutoencoderKL hold NaN or Inf", BAD_DATA),
    Case("engine-model-nan-text-encoder", lambda t: engine(t, pretrained_model_name_or_path=str(tiny_model_with(
        t / "m.safetensors", "cond_stage_model."))), "CLIPTextModel hold NaN or Inf", BAD_DATA),
    Case("run-model-nan-weights", lambda t: run(t, "--skip-doctor", model=str(tiny_model_with(
        t / "m.safetensors", "model.diffusion_model."))), "hold NaN or Inf", BAD_DATA),
]

LORAS = [
    Case("inspect-text-as-safetensors", lambda t: ["autotune", "inspect", str(text_file(t / "l.safetensors"))],
         "l.safetensors"),
    Case("inspect-truncated", lambda t: ["autotune", "inspect", str(lora_like(t / "l.safetensors", True))],
         "l.safetensors"),
    Case("inspect-base-model", lambda t: ["autotune", "inspect", str(safetensors_file(
        t / "l.safetensors", {"model.diffusion_model.input_blocks.0.0.weight": np.zeros((4, 4), np.float32)}))],
        "base model"),
    Case("inspect-no-tensors", lambda t: ["autotune", "inspect", str(safetensors_file(t / "l.safetensors", {}))],
         "no tensors"),
    Case("inspect-peft-keys", lambda t: ["autotune", "inspect", str(safetensors_file(
        t / "l.safetensors", {"unet.down.lora_A.weight": np.zeros((4, 4), np.float32)}))], "lora_A"),
    Case("inspect-pickle", lambda t: ["autotune", "inspect", str(a_file(t / "l.pt"))], "l.pt"),
    Case("inspect-a-folder", lambda t: ["autotune", "inspect", str(dataset(t))], "data"),
    Case("train-network-weights-missing", lambda t: train(t, network_weights=str(t / "nope.safetensors")),
         "nope.safetensors"),
    Case("train-network-weights-text", lambda t: train(t, network_weights=str(text_file(t / "w.safetensors"))),
         "w.safetensors"),
    Case("train-network-weights-truncated", lambda t: train(t, network_weights=str(
        lora_like(t / "w.safetensors", truncate=True))), "w.safetensors"),
    Case("train-network-weights-base-model", lambda t: train(t, network_weights=str(safetensors_file(
        t / "w.safetensors", {"model.diffusion_model.x.weight": np.zeros((4, 4), np.float32)}))), "w.safetensors"),
    Case("engine-network-weights-nan", lambda t: engine(t, network_weights=str(lora_with(
        t / "w.safetensors", float("nan")))), "LoRA weights to start from hold NaN or Inf", BAD_DATA),
    Case("train-network-weights-inf", lambda t: train(t, network_weights=str(lora_with(
        t / "w.safetensors", float("-inf")))), "w.safetensors", BAD_DATA),
    Case("engine-network-weights-nan-dim-from-weights", lambda t: engine(t, network_weights=str(lora_with(
        t / "w.safetensors", float("nan"))), dim_from_weights=True), "hold NaN or Inf", BAD_DATA),
]

INTERRUPTIONS = [
    Case("train-resume-missing", lambda t: train(t, "--resume", str(t / "nope-state")), "nope-state"),
    Case("train-resume-not-a-state", lambda t: train(t, "--resume", str(state_folder(t, broken=False))),
         "not a lora-autotune state"),
    Case("train-resume-broken-state", lambda t: train(t, "--resume", str(state_folder(t, broken=True))),
         "lora-state"),
    Case("engine-resume-a-file", lambda t: engine(t, "--resume", str(a_file(t / "f"))), "f"),
]

def finished_run(root: Path) -> Path:
    """An events folder with a minimal done.json (what another engine might leave)."""
    text_file(root / "done.json", '{"schema": 1, "event": "done", "steps": 1}')
    return root


REPORTS = [
    Case("report-missing", lambda t: ["autotune", "report", str(t / "nope")], "nope"),
    Case("report-a-file", lambda t: ["autotune", "report", str(a_file(t / "f"))], "no such folder"),
    Case("report-empty-folder", lambda t: ["autotune", "report", str(t)], "no run to report"),
    Case("report-garbage-events", lambda t: ["autotune", "report", str(text_file(t / "done.json", "{{{").parent)],
         "no run to report"),
    Case("report-html-under-a-file", lambda t: ["autotune", "report", str(finished_run(t / "ev")), "--html",
                                                str(a_file(t / "g") / "r.html")], "--html"),
    # writes never replace what is not a regular file (as root the rename would replace the device node)
    Case("report-html-dev-null", lambda t: ["autotune", "report", str(finished_run(t / "ev")), "--html", "/dev/null"],
         "/dev/null is a device"),
    Case("doctor-html-dev-null", lambda t: ["autotune", "doctor", str(dataset(t)), "--html", "/dev/null"],
         "/dev/null is a device"),
    Case("doctor-html-fifo", lambda t: ["autotune", "doctor", str(dataset(t)), "--html", str(fifo(t / "pipe"))],
         "is a FIFO"),
    Case("doctor-html-a-folder", lambda t: ["autotune", "doctor", str(dataset(t)), "--html", str(t)], "is a folder"),
]


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def bench(root: Path, *extra: str, model: str = TINY) -> list[str]:
    return ["autotune", "bench", "--model", model, *extra]


def dataset_toml(root: Path, body: str) -> list[str]:
    """The engine with a dataset.toml whose one subset (the good images) gets ``body`` as extra lines."""
    text = f'[[datasets]]\nresolution = 64\n[[datasets.subsets]]\nimage_dir = "{dataset(root) / "2_toy"}"\n{body}\n'
    return engine(root, "--dataset_config", str(text_file(root / "d.toml", text)), train_data_dir=None)


def flux(root: Path, **overrides: object) -> list[str]:
    values: dict[str, object] = {"pretrained_model_name_or_path": "builtin:tiny-flux", "t5xxl_max_token_length": 16,
                                 "network_train_unet_only": True, **overrides}
    return ["sd_scripts_compat.flux_train_network", "--config_file", str(config(root, **values))]


def flux_files_of(root: Path, t5_layers: int = 0, unet: dict | None = None, **overrides: object) -> list[str]:
    """The engine on tiny-flux's four files, its T5 ``t5_layers`` deeper and its transformer with ``unet``'s
    block counts (a T5 deeper than the family's is refused; a pruned transformer swaps fewer blocks)."""
    import dataclasses

    from sd_scripts_compat.facts.families import get_family
    from sd_scripts_compat.models.build import build_modules
    from sd_scripts_compat.models.flux_files import save_flux_files

    family = get_family("tiny-flux")
    encoders = tuple(dataclasses.replace(te, config={**te.config, "num_layers": int(te.config["num_layers"]) +
                                                     t5_layers}) if te.file_option == "t5xxl" else te
                     for te in family.text_encoders)
    spec = dataclasses.replace(family, unet={**family.unet, **(unet or {})}, text_encoders=encoders)
    files = save_flux_files(build_modules(spec), root / "flux")
    return flux(root, **{option: str(path) for option, path in files.items()}, **overrides)


def sd3(root: Path, **overrides: object) -> list[str]:
    values: dict[str, object] = {"pretrained_model_name_or_path": "builtin:tiny-sd3", "t5xxl_max_token_length": 16,
                                 "network_train_unet_only": True, "network_module": "networks.lora_sd3", **overrides}
    return ["sd_scripts_compat.sd3_train_network", "--config_file", str(config(root, **values))]


def sd3_lora(root: Path) -> Path:
    """A tiny-sd3 LoRA file as our engine writes it (kohya names, SD3.5 Medium metadata)."""
    from sd_scripts_compat.facts.families import get_family
    from sd_scripts_compat.models.build import build_modules
    from sd_scripts_compat.network.lora import create_network
    from sd_scripts_compat.network.lora_file import TrainingFacts, build_metadata, save_lora_file

    bundle = build_modules(get_family("tiny-sd3"))
    facts = TrainingFacts(output_name="lora", network_dim=4, network_alpha=4.0, learning_rate=1e-4,
                          optimizer="AdamW", resolution=(64, 64), training_started_at=1.7e9, session_id=1, steps=1)
    path = root / "lora.safetensors"
    save_lora_file(path, create_network(bundle, network_dim=4).kohya_state_dict(), build_metadata(bundle.family, facts))
    return path


def huge_header(path: Path) -> Path:
    """A .safetensors whose header claims to be 2**60 bytes long."""
    path.write_bytes((2**60).to_bytes(8, "little") + b"{}")
    return path


# issue 22's own: more of what a new user does, across every command and the engine's entry points
MORE = [
    Case("bench-steps-zero", lambda t: bench(t, "--steps", "0"), "--steps"),
    Case("bench-steps-negative", lambda t: bench(t, "--steps", "-3"), "--steps"),
    Case("bench-warmup-negative", lambda t: bench(t, "--warmup", "-1"), "--warmup"),
    Case("bench-sweep-unknown-key", lambda t: bench(t, "--sweep", "speed=1,2"), "speed"),
    Case("bench-sweep-no-values", lambda t: bench(t, "--sweep", "batch="), "--sweep"),
    Case("bench-sweep-batch-zero", lambda t: bench(t, "--sweep", "batch=0,2"), "batch"),
    Case("bench-sweep-not-key-value", lambda t: bench(t, "--sweep", "batch"), "--sweep"),
    Case("bench-sweep-precision-unknown", lambda t: bench(t, "--sweep", "precision=fp64"), "fp64"),
    Case("bench-sweep-resolution-off-step", lambda t: bench(t, "--sweep", "resolution=70"), "70"),
    Case("bench-sweep-checkpointing-maybe", lambda t: bench(t, "--sweep", "checkpointing=maybe"), "maybe"),
    Case("bench-sweep-optimizer-unknown", lambda t: bench(t, "--sweep", "optimizer=SuperAdam"), "SuperAdam"),
    Case("bench-sweep-compile-backend-unknown", lambda t: bench(t, "--sweep", "compile=warp"), "warp"),
    Case("bench-stall-timeout-inf", lambda t: bench(t, "--stall-timeout", "inf"), "--stall-timeout"),
    Case("bench-memory-limit-nan", lambda t: bench(t, "--memory-limit", "nan"), "--memory-limit"),
    Case("bench-model-missing", lambda t: bench(t, model=str(t / "nope.safetensors")), "nope.safetensors"),
    Case("bench-model-int8", lambda t: bench(t, model=str(quantized_model(t / "m.safetensors"))), "quantized"),
    Case("bench-keep-under-a-file", lambda t: bench(t, "--keep", str(a_file(t / "f") / "k")), "f"),
    Case("bench-config-missing", lambda t: bench(t, "--config", str(t / "nope.toml")), "nope.toml"),
    Case("bench-dataset-missing", lambda t: [*bench(t), str(t / "nope")], "nope"),
    Case("bench-out-it-does-not-write", lambda t: bench(t, "--out", str(a_file(t / "f"))), "--out"),
    Case("plan-rank-negative", lambda t: plan(t, "--rank", "-4"), "--rank"),
    Case("plan-workers-negative", lambda t: plan(t, "--workers", "-1"), "--workers"),
    Case("plan-network-arg-unknown", lambda t: plan(t, "--network", "locon", "--network-arg", "foo=1"), "foo"),
    Case("plan-network-arg-no-equals", lambda t: plan(t, "--network", "locon", "--network-arg", "conv_dim"),
         "conv_dim"),
    Case("plan-network-lokr-on-flux", lambda t: plan(t, "--network", "lokr", model="builtin:tiny-flux"), "FLUX"),
    Case("plan-format-unknown", lambda t: plan(t, "--format", "onetrainer"), "onetrainer"),
    Case("plan-config-malformed", lambda t: plan(t, "--config", str(text_file(t / "c.toml", 'a = "open\n'))),
         "c.toml"),
    Case("plan-dataset-config-missing", lambda t: plan(t, "--config", str(config(t)), "--dataset-config",
                                                       str(t / "nope.toml")), "nope.toml"),
    Case("plan-dataset-is-a-file", lambda t: ["autotune", "plan", str(a_file(t / "f")), "--model", TINY], "f"),
    Case("plan-dataset-empty", lambda t: ["autotune", "plan", str((t / "e").mkdir() or t / "e"), "--model", TINY],
         "e"),
    Case("plan-resolution-garbage", lambda t: plan(t, "--resolution", "big"), "--resolution"),
    Case("plan-resolution-three-values", lambda t: plan(t, "--resolution", "64,64,64"), "--resolution"),
    Case("plan-epochs-not-an-integer", lambda t: plan(t, "--epochs", "1.5"), "--epochs"),
    Case("plan-cpu-cores-negative", lambda t: plan(t, "--cpu-cores", "-2"), "--cpu-cores"),
    Case("plan-ram-zero", lambda t: plan(t, "--ram", "0"), "--ram"),
    Case("plan-out-is-dev-null", lambda t: plan(t, "--out", "/dev/null"), "/dev/null"),
    Case("run-resolution-garbage", lambda t: run(t, "--resolution", "big"), "--resolution"),
    Case("run-rank-zero", lambda t: run(t, "--rank", "0"), "--rank 0"),
    Case("run-network-arg-bad-value", lambda t: run(t, "--network", "locon", "--network-arg", "conv_dim=x"),
         "conv_dim"),
    Case("run-engine-path-missing", lambda t: run(t, "--engine", f"sd-scripts={t / 'nope'}"), "nope"),
    Case("run-engine-bad-form", lambda t: run(t, "--engine", "kohya"), "--engine"),
    Case("run-out-is-dev-null", lambda t: ["autotune", "run", str(dataset(t)), "--model", TINY, "--out", "/dev/null"],
         "/dev/null"),
    Case("run-config-a-folder", lambda t: run(t, "--config", str((t / "cfg").mkdir() or t / "cfg")), "cfg"),
    Case("run-save-state-every-nan", lambda t: run(t, "--save-state-every", "nan"), "--save-state-every"),
    Case("run-dataset-config-malformed", lambda t: run(t, "--config", str(config(t)), "--dataset-config",
                                                       str(text_file(t / "d.toml", "[[datasets]\n"))), "d.toml"),
    Case("doctor-dataset-is-a-file", lambda t: ["autotune", "doctor", str(a_file(t / "f"))], "f"),
    Case("doctor-symlink-loop", lambda t: ["autotune", "doctor", str(symlink_loop(t / "loop"))], "loop"),
    Case("doctor-html-under-a-file", lambda t: ["autotune", "doctor", str(dataset(t)), "--html",
                                                str(a_file(t / "f") / "d.html")], "--html"),
    Case("doctor-config-malformed", lambda t: ["autotune", "doctor", str(dataset(t)), "--config",
                                               str(text_file(t / "c.toml", 'a = "open\n'))], "c.toml"),
    Case("doctor-config-binary", lambda t: ["autotune", "doctor", str(dataset(t)), "--config",
                                            str(binary(t / "c.toml"))], "c.toml"),
    Case("doctor-resolution-garbage", lambda t: ["autotune", "doctor", str(dataset(t)), "--resolution", "x"],
         "--resolution"),
    Case("report-html-a-folder", lambda t: ["autotune", "report", str(finished_run(t / "ev")), "--html",
                                            str(t)], "is a folder"),
    Case("report-html-fifo", lambda t: ["autotune", "report", str(finished_run(t / "ev")), "--html",
                                        str(fifo(t / "pipe"))], "is a FIFO"),
    Case("report-done-json-a-list", lambda t: ["autotune", "report", str(text_file(t / "done.json", "[]").parent)],
         "no run to report"),
    Case("report-done-json-other-schema", lambda t: ["autotune", "report", str(text_file(
        t / "done.json", '{"schema": 99, "event": "done", "steps": 1}').parent)], "no run to report"),
    Case("inspect-empty-file", lambda t: ["autotune", "inspect", str(text_file(t / "l.safetensors", ""))],
         "l.safetensors"),
    Case("inspect-header-length-huge", lambda t: ["autotune", "inspect", str(huge_header(t / "l.safetensors"))],
         "l.safetensors"),
    Case("inspect-symlink-loop", lambda t: ["autotune", "inspect", str(symlink_loop(t / "loop"))], "loop"),
    Case("inspect-unknown-suffix", lambda t: ["autotune", "inspect", str(a_file(t / "l.bin"))], "l.bin"),
    Case("inspect-dev-null", lambda t: ["autotune", "inspect", "/dev/null"], "/dev/null"),
    Case("engine-network-dim-zero", lambda t: engine(t, network_dim=0), "network_dim"),
    Case("engine-network-alpha-nan", lambda t: engine(t, network_alpha=float("nan")), "network_alpha"),
    Case("engine-gradient-accumulation-zero", lambda t: engine(t, gradient_accumulation_steps=0),
         "gradient_accumulation_steps"),
    Case("engine-max-train-epochs-negative", lambda t: engine(t, max_train_epochs=-1), "max_train_epochs"),
    Case("engine-lr-scheduler-unknown", lambda t: engine(t, lr_scheduler="sometimes"), "sometimes"),
    Case("engine-mixed-precision-unknown", lambda t: engine(t, mixed_precision="fp8"), "mixed_precision"),
    Case("engine-save-precision-unknown", lambda t: engine(t, save_precision="int4"), "save_precision"),
    Case("engine-dynamo-backend-unknown", lambda t: engine(t, torch_compile=True, dynamo_backend="warp"),
         "dynamo_backend"),
    Case("engine-caption-dropout-above-one", lambda t: engine(t, caption_dropout_rate=1.5), "caption_dropout_rate"),
    Case("engine-noise-offset-nan", lambda t: engine(t, noise_offset=float("nan")), "noise_offset"),
    Case("engine-min-snr-gamma-negative", lambda t: engine(t, min_snr_gamma=-5.0), "min_snr_gamma"),
    Case("engine-keep-tokens-negative", lambda t: engine(t, keep_tokens=-2), "keep_tokens"),
    Case("engine-resolution-zero", lambda t: engine(t, resolution="0,0"), "resolution"),
    Case("engine-bucket-steps-zero", lambda t: engine(t, enable_bucket=True, bucket_reso_steps=0),
         "bucket_reso_steps"),
    Case("engine-min-bucket-above-max", lambda t: engine(t, enable_bucket=True, min_bucket_reso=512,
                                                         max_bucket_reso=256), "bucket_reso"),
    Case("engine-network-module-unknown", lambda t: engine(t, network_module="networks.magic"), "networks.magic"),
    Case("engine-output-dir-is-a-file", lambda t: engine(t, output_dir=str(a_file(t / "f"))), "output_dir"),
    Case("engine-clip-skip-zero", lambda t: engine(t, clip_skip=0), "clip_skip"),
    Case("engine-max-token-length-100", lambda t: engine(t, max_token_length=100), "max_token_length"),
    Case("engine-sample-sampler-unknown", lambda t: engine(t, sample_sampler="warp_drive", sample_prompts=str(
        text_file(t / "p.txt", "a cat --w 64 --h 64\n")), sample_every_n_steps=1), "warp_drive"),
    Case("engine-sample-prompts-missing", lambda t: engine(t, sample_prompts=str(t / "nope.txt"),
                                                           sample_every_n_steps=1), "nope.txt"),
    Case("engine-sdxl-script-on-sd15", lambda t: ["sd_scripts_compat.sdxl_train_network", "--config_file",
                                                  str(config(t))], "train_network"),
    Case("engine-sd15-script-on-sdxl", lambda t: engine(t, pretrained_model_name_or_path="builtin:tiny-sdxl"),
         "sdxl_train_network"),
    Case("flux-guidance-scale-nan", lambda t: flux(t, guidance_scale=float("nan")), "guidance_scale"),
    Case("flux-timestep-sampling-unknown", lambda t: flux(t, timestep_sampling="random"), "timestep_sampling"),
    Case("flux-blocks-to-swap-negative", lambda t: flux(t, blocks_to_swap=-1), "blocks_to_swap"),
    Case("flux-t5-max-length-zero", lambda t: flux(t, t5xxl_max_token_length=0), "t5xxl_max_token_length"),
    Case("flux-discrete-flow-shift-inf", lambda t: flux(t, discrete_flow_shift=float("inf")), "discrete_flow_shift"),
    Case("flux-t5-file-deeper-than-t5xxl", lambda t: flux_files_of(t, t5_layers=1), "t5xxl"),
    Case("flux-pruned-file-swaps-more-than-its-blocks",
         lambda t: flux_files_of(t, unet={"num_layers": 1, "num_single_layers": 1}, blocks_to_swap=2),
         "swaps none; remove blocks_to_swap"),
    Case("flux-on-an-sd15-model", lambda t: flux(t, pretrained_model_name_or_path=TINY), "train_network"),
    Case("ui-port-zero", lambda t: ["autotune", "ui", "--port", "0"], "--port 0"),
    Case("ui-allow-dir-missing", lambda t: ["autotune", "ui", "--allow-dir", str(t / "nope")], "--allow-dir"),
    Case("ui-runs-is-a-file", lambda t: ["autotune", "ui", "--runs", str(a_file(t / "runs"))], "--runs"),
    Case("ui-engine-not-sd-scripts", lambda t: ["autotune", "ui", "--engine", f"sd-scripts={t}"], "not sd-scripts"),
    Case("ui-engine-unknown-kind", lambda t: ["autotune", "ui", "--engine", "musubi=/x"], "expected sd-scripts=PATH"),
    Case("ui-python-without-engine", lambda t: ["autotune", "ui", "--python", sys.executable], "only with --engine"),
    Case("ui-engine-not-musubi", lambda t: ["autotune", "ui", "--engine", f"musubi-tuner={t}"],
         "not a musubi-tuner checkout"),
    Case("flux-offload-with-block-swap", lambda t: flux(t, cpu_offload_checkpointing=True, blocks_to_swap=2),
         "blocks_to_swap cannot go with it"),
    Case("sd3-clip-g-is-a-t5-file", lambda t: sd3(t, clip_g=str(safetensors_file(
        t / "t5.safetensors", {"encoder.block.0.layer.0.SelfAttention.q.weight": np.zeros((2, 2), np.float32)}))),
         "holds a T5 encoder, not what clip_g needs"),
    Case("sd3-clip-g-on-flux", lambda t: flux(t, clip_g=str(a_file(t / "g.safetensors"))), "clip_g"),
    Case("run-clip-g-file-missing", lambda t: ["autotune", "run", str(dataset(t)), "--model", "builtin:tiny-sd3",
                                               "--clip_g", str(t / "nope.safetensors"), "--out", str(t / "o")],
         "--clip_g"),
    Case("plan-gemma2-for-sd3", lambda t: ["autotune", "plan", str(dataset(t)), "--model", "builtin:tiny-sd3",
                                           "--gemma2", str(a_file(t / "g.safetensors"))], "takes no gemma2 file"),
    Case("inspect-diffusers-out-over-the-lora", lambda t: ["autotune", "inspect", str(sd3_lora(t)),
                                                           "--diffusers-out", str(t / "lora.safetensors")],
         "would overwrite the LoRA"),
    Case("dataset-toml-resolution-garbage", lambda t: engine(t, "--dataset_config", str(text_file(
        t / "d.toml", f'[[datasets]]\nresolution = "big"\n[[datasets.subsets]]\nimage_dir = "{dataset(t)}"\n')),
        train_data_dir=None), "resolution"),
    Case("dataset-toml-subset-key-typo", lambda t: dataset_toml(t, "num_repeat = 2"), "num_repeat"),
    Case("dataset-toml-caption-extension-number", lambda t: dataset_toml(t, "caption_extension = 5"),
         "caption_extension"),
    Case("dataset-toml-image-dir-a-file", lambda t: engine(t, "--dataset_config", str(text_file(
        t / "d.toml", f'[[datasets]]\n[[datasets.subsets]]\nimage_dir = "{a_file(t / "f")}"\n')),
        train_data_dir=None), "f"),
    Case("dataset-toml-flip-aug-string", lambda t: dataset_toml(t, 'flip_aug = "yes"'), "flip_aug"),
    Case("dataset-toml-batch-size-float", lambda t: engine(t, "--dataset_config", str(text_file(
        t / "d.toml", f'[[datasets]]\nbatch_size = 1.5\n[[datasets.subsets]]\nimage_dir = "{dataset(t)}"\n')),
        train_data_dir=None), "batch_size"),
    Case("dataset-toml-num-repeats-negative", lambda t: dataset_toml(t, "num_repeats = -3"), "num_repeats"),
    Case("dataset-toml-caption-dropout-nan", lambda t: dataset_toml(t, "caption_dropout_rate = nan"),
         "caption_dropout_rate"),
    Case("dataset-toml-color-aug", lambda t: dataset_toml(t, "color_aug = true"), "color_aug"),
    Case("dataset-toml-secondary-separator-without-shuffle", lambda t: dataset_toml(
        t, 'keep_tokens_separator = "|||"\nkeep_tokens = -1'), "keep_tokens"),
]

# issue 47's pass: files lost, tracebacks, silently wrong answers and hangs it found outside the web app
def run_folder(root: Path) -> Path:
    """A finished run's folder as autotune run leaves it: its plan, config, decisions and LoRA."""
    out = root / "run"
    config(out, output_dir=str(out))
    text_file(out / "autotune_plan.json", "{}")
    text_file(out / "logs" / "decisions.jsonl", '{"event": "done", "text": "done"}\n')
    finished_run(out / "logs" / "events")
    lora_like(out / "lora.safetensors")
    return out


def prompts(root: Path, line: str, name: str = "p.txt") -> str:
    return str(text_file(root / name, line + "\n"))


def sampled(root: Path, line: str) -> list[str]:
    return engine(root, sample_prompts=prompts(root, line), sample_every_n_steps=1)


def lycoris(root: Path, *args: str) -> list[str]:
    return engine(root, network_module="lycoris.kohya", network_args=list(args))


ISSUE_47 = [
    Case("report-html-over-the-runs-lora", lambda t: ["autotune", "report", str(run_folder(t)), "--html",
                                                      str(t / "run" / "lora.safetensors")], "did not write"),
    Case("report-html-over-the-runs-config", lambda t: ["autotune", "report", str(run_folder(t)), "--html",
                                                        str(t / "run" / "config.toml")], "did not write"),
    Case("report-html-over-a-users-page", lambda t: ["autotune", "report", str(run_folder(t)), "--html",
                                                     str(text_file(t / "notes.html", "<html>mine</html>"))],
         "did not write"),
    Case("doctor-html-over-a-users-page", lambda t: ["autotune", "doctor", str(dataset(t)), "--html",
                                                     str(text_file(t / "notes.html", "<html>mine</html>"))],
         "did not write"),
    Case("doctor-html-inside-the-dataset", lambda t: ["autotune", "doctor", str(dataset(t)), "--html",
                                                      str(t / "data" / "2_toy" / "r.html")], "inside the dataset"),
    Case("plan-out-over-a-finished-run", lambda t: plan(t, "--out", str(run_folder(t))), "holds a run"),
    Case("plan-out-over-a-users-config", lambda t: plan(t, "--out", str(config(t / "mine").parent)),
         "autotune did not write"),
    Case("plan-out-is-the-dataset", lambda t: plan(t, "--out", str(t / "data")), "inside the dataset"),
    Case("plan-out-inside-a-subset", lambda t: plan(t, "--out", str(t / "data" / "2_toy" / "o")),
         "inside the dataset"),
    Case("run-out-is-the-dataset", lambda t: ["autotune", "run", str(dataset(t)), "--model", TINY, "--out",
                                              str(t / "data")], "inside the dataset"),
    Case("run-out-inside-a-subset", lambda t: ["autotune", "run", str(dataset(t)), "--model", TINY, "--out",
                                               str(t / "data" / "2_toy" / "o")], "inside the dataset"),
    Case("run-out-in-a-symlink-loop", lambda t: ["autotune", "run", str(dataset(t)), "--model", TINY, "--out",
                                                 str(symlink_loop(t / "l") / "x")], "--out"),
    Case("inspect-diffusers-out-over-another-file", lambda t: [
        "autotune", "inspect", str(sd3_lora(t)), "--diffusers-out", str(lora_like(t / "mine.safetensors"))],
         "did not write"),
    Case("engine-adafactor-with-adamw-options", lambda t: engine(t, optimizer_type="AdaFactor",
                                                                 optimizer_args=["betas=0.9,0.99"]), "betas"),
    Case("engine-dylora-block-size-zero", lambda t: lycoris(t, "algo=dylora", "block_size=0"), "block_size"),
    Case("engine-betas-one-value", lambda t: engine(t, optimizer_args=["betas=0.9"]), "betas"),
    Case("engine-fused-and-foreach", lambda t: engine(t, optimizer_args=["fused=True", "foreach=True"]), "fused"),
    Case("engine-lion-three-betas", lambda t: engine(t, optimizer_type="Lion", optimizer_args=["betas=0.9,0.99,0.5"]),
         "betas"),
    Case("engine-sample-prompts-latin-1", lambda t: engine(t, sample_prompts=str(binary_text(t / "p.txt")),
                                                           sample_every_n_steps=1), "p.txt"),
    Case("engine-seed-over-2-63", lambda t: engine(t, seed=2**64), "seed"),
    Case("engine-caption-extension-png", lambda t: engine(t, caption_extension=".png"), "caption_extension"),
    Case("doctor-caption-extension-png", lambda t: ["autotune", "doctor", str(dataset(t)), "--caption-extension",
                                                    ".png"], "--caption-extension"),
    Case("engine-sample-width-negative", lambda t: sampled(t, "a cat --w -64 --h 64"), "--w"),
    Case("engine-sample-scale-nan", lambda t: sampled(t, "a cat --w 64 --h 64 --l nan"), "--l"),
    Case("engine-sample-steps-negative", lambda t: sampled(t, "a cat --w 64 --h 64 --s -5"), "--s"),
    Case("engine-sample-100000-px", lambda t: sampled(t, "a cat --w 100000 --h 100000"), "--w"),
    Case("engine-dim-from-weights-without-weights", lambda t: engine(t, dim_from_weights=True), "network_weights"),
    Case("engine-unet-only-and-te-only", lambda t: engine(t, network_train_unet_only=True,
                                                          network_train_text_encoder_only=True),
         "text encoders alone is not implemented"),
    Case("engine-lokr-factor-zero", lambda t: lycoris(t, "algo=lokr", "factor=0"), "factor"),
    Case("engine-lokr-factor-minus-two", lambda t: lycoris(t, "algo=lokr", "factor=-2"), "factor"),
    Case("engine-every-block-dim-zero", lambda t: engine(t, network_args=["block_dims=" + ",".join(["0"] * 25),
                                                                          "block_alphas=" + ",".join(["1"] * 25)]),
         "block_dims"),
    Case("run-python-without-engine", lambda t: run(t, "--python", sys.executable), "--python"),
    Case("plan-vram-in-bytes", lambda t: plan(t, "--vram", "25769803776"), "--vram"),
    Case("plan-gpu-with-a-snowman", lambda t: plan(t, "--gpu", "RTX 4090 \u2603"), "is in no card's name"),
    Case("plan-network-loha-with-algo-lokr", lambda t: plan(t, "--network", "loha", "--network-arg", "algo=lokr"),
         "algo"),
    Case("doctor-flux-resolution-70", lambda t: ["autotune", "doctor", str(dataset(t)), "--model", "builtin:tiny-flux",
                                                 "--resolution", "70"], "--resolution 70"),
    Case("run-dataset-config-without-config", lambda t: run(t, "--dataset-config", str(batch_zero(t))),
         "needs --config"),
    Case("run-dataset-config-batch-size-zero", lambda t: run(t, "--dataset-config", str(batch_zero(t)), "--config",
                                                             str(config(t / "c"))), "batch_size"),
    Case("bench-sweep-one-key-twice", lambda t: bench(t, "--sweep", "batch=1,2", "--sweep", "batch=4"), "batch"),
    Case("engine-lycoris-ia3", lambda t: lycoris(t, "algo=ia3"), "algo=ia3"),
    Case("wizard-trigger-with-a-slash", lambda t: ["autotune", "wizard", str(flat_folder(t)), "--model", TINY, "--cpu",
                                                   "--organise", "copy", "--trigger", "a/b", "--yes", "--no-start"],
         "--trigger"),
]

# our own, beside issue 47's: the same kinds of input, one step further
def opt(root: Path, *args: str, name: str = "AdamW") -> list[str]:
    return engine(root, optimizer_type=name, optimizer_args=list(args))


def json_prompts(root: Path, data: str) -> list[str]:
    return engine(root, sample_prompts=prompts(root, data, "p.json"), sample_every_n_steps=1)


def toml_prompts(root: Path, data: str) -> list[str]:
    return engine(root, sample_prompts=prompts(root, data, "p.toml"), sample_every_n_steps=1)


def flat_folder(root: Path) -> Path:
    """A flat folder of images (no N_name subfolders), what the wizard organises."""
    data = dataset(root)
    flat = root / "flat"
    (data / "2_toy").rename(flat)
    data.rmdir()
    return flat


def subfolder_link(root: Path) -> Path:
    data = dataset(root)
    (root / "link").symlink_to(data / "2_toy")
    return root / "link" / "o"


def folder_with(root: Path, *names: str) -> Path:
    out = root / "o"
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        text_file(out / name, "{}\n" if name.endswith((".json", ".jsonl")) else "x = 1\n")
    return out


OWN_47 = [
    Case("engine-betas-word", lambda t: opt(t, "betas=a,b"), "betas"),
    Case("engine-betas-above-one", lambda t: opt(t, "betas=0.9,1.5"), "betas"),
    Case("engine-betas-negative", lambda t: opt(t, "betas=-0.1,0.9"), "betas"),
    Case("engine-betas-four-values", lambda t: opt(t, "betas=0.9,0.99,0.5,0.1"), "betas"),
    Case("engine-lion-one-beta", lambda t: opt(t, "betas=0.9", name="Lion"), "betas"),
    Case("engine-adamw8bit-one-beta", lambda t: opt(t, "betas=0.95", name="AdamW8bit"), "betas"),
    Case("engine-eps-negative", lambda t: opt(t, "eps=-1e-8"), "eps"),
    Case("engine-weight-decay-negative", lambda t: opt(t, "weight_decay=-0.1"), "weight_decay"),
    Case("engine-adamw-momentum", lambda t: opt(t, "momentum=0.9"), "momentum"),
    Case("engine-foreach-and-fused-lower-case", lambda t: opt(t, "fused=true", "foreach=true"), "fused"),
    Case("engine-adafactor-betas", lambda t: opt(t, "betas=0.9,0.99", name="adafactor"), "betas"),
    Case("engine-lr-scheduler-adafactor-with-adamw8bit", lambda t: engine(
        t, optimizer_type="AdamW8bit", lr_scheduler="adafactor"), "AdaFactor's own schedule"),
    Case("engine-sample-height-zero", lambda t: sampled(t, "a cat --w 64 --h 0"), "--h 0"),
    Case("engine-sample-height-negative", lambda t: sampled(t, "a cat --w 64 --h -8"), "--h -8"),
    Case("engine-sample-width-9000", lambda t: sampled(t, "a cat --w 9000 --h 64"), "--w 9000"),
    Case("engine-sample-steps-zero", lambda t: sampled(t, "a cat --w 64 --h 64 --s 0"), "--s 0"),
    Case("engine-sample-steps-5000", lambda t: sampled(t, "a cat --w 64 --h 64 --s 5000"), "--s 5000"),
    Case("engine-sample-scale-inf", lambda t: sampled(t, "a cat --w 64 --h 64 --l inf"), "--l inf"),
    Case("engine-sample-scale-negative", lambda t: sampled(t, "a cat --w 64 --h 64 --l -1"), "--l -1"),
    Case("engine-sample-guidance-nan", lambda t: sampled(t, "a cat --w 64 --h 64 --g nan"), "--g nan"),
    Case("engine-sample-seed-negative", lambda t: sampled(t, "a cat --w 64 --h 64 --d -1"), "--d -1"),
    Case("engine-sample-seed-2-64", lambda t: sampled(t, "a cat --w 64 --h 64 --d 18446744073709551616"), "--d"),
    Case("engine-sample-prompts-yaml", lambda t: engine(t, sample_prompts=prompts(t, "a cat", "p.yaml"),
                                                        sample_every_n_steps=1), ".toml or .json"),
    Case("engine-json-prompts-not-a-list", lambda t: json_prompts(t, '{"prompt": "a cat"}'), "a list"),
    Case("engine-json-prompts-numbers", lambda t: json_prompts(t, "[1, 2]"), "each prompt is a table"),
    Case("engine-json-prompts-unknown-key", lambda t: json_prompts(t, '[{"prompt": "a", "cfg": 7}]'), "'cfg'"),
    Case("engine-json-prompts-width-string", lambda t: json_prompts(t, '[{"prompt": "a", "width": "64"}]'),
         "width"),
    Case("engine-json-prompts-width-bool", lambda t: json_prompts(t, '[{"prompt": "a", "width": true}]'), "width"),
    Case("engine-json-prompts-broken", lambda t: json_prompts(t, '[{"prompt": '), "not a valid json"),
    Case("engine-json-prompts-deep", lambda t: json_prompts(t, "[" * 50_000 + "]" * 50_000), "p.json"),
    Case("engine-json-prompts-huge-side", lambda t: json_prompts(t, '[{"prompt": "a", "height": 100000}]'),
         "--h 100000"),
    Case("engine-json-prompts-bad-line", lambda t: json_prompts(t, '["a cat --w big"]'), "--w"),
    Case("engine-toml-prompts-no-subset", lambda t: toml_prompts(t, '[prompt]\nwidth = 64'), "[[prompt.subset]]"),
    Case("engine-toml-prompts-steps-float", lambda t: toml_prompts(
        t, '[prompt]\n[[prompt.subset]]\nprompt = "a"\nsample_steps = 2.5'), "sample_steps"),
    Case("engine-toml-prompts-seed-negative", lambda t: toml_prompts(
        t, '[prompt]\n[[prompt.subset]]\nprompt = "a"\nseed = -4'), "--d -4"),
    Case("engine-lokr-factor-minus-three", lambda t: lycoris(t, "algo=lokr", "factor=-3"), "factor"),
    Case("engine-lokr-factor-word", lambda t: lycoris(t, "algo=lokr", "factor=big"), "factor"),
    Case("engine-dylora-block-size-negative", lambda t: lycoris(t, "algo=dylora", "block_size=-1"), "block_size"),
    Case("engine-lycoris-conv-dim-negative", lambda t: lycoris(t, "algo=locon", "conv_dim=-1"), "conv_dim"),
    Case("engine-lora-conv-dim-negative", lambda t: engine(t, network_args=["conv_dim=-2"]), "conv_dim"),
    Case("engine-rank-dropout-one", lambda t: engine(t, network_args=["rank_dropout=1.0"]), "rank_dropout"),
    Case("engine-module-dropout-negative", lambda t: engine(t, network_args=["module_dropout=-0.1"]),
         "module_dropout"),
    Case("engine-every-block-weight-zero", lambda t: engine(t, network_args=[
        "down_lr_weight=zeros", "mid_lr_weight=0", "up_lr_weight=zeros"]), "nothing"),
    Case("engine-caption-extension-jpg", lambda t: engine(t, caption_extension=".jpg"), "caption_extension"),
    Case("engine-caption-extension-upper-jpeg", lambda t: engine(t, caption_extension=".JPEG"), "caption_extension"),
    Case("engine-caption-extension-webp", lambda t: engine(t, caption_extension=".webp"), "caption_extension"),
    Case("engine-seed-2-32", lambda t: engine(t, seed=2**32), "seed"),
    Case("engine-text-encoder-only", lambda t: engine(t, network_train_text_encoder_only=True),
         "text encoders alone"),
    Case("engine-dim-from-weights-no-weights-sdxl", lambda t: engine(
        t, "--dim_from_weights"), "network_weights"),
    Case("plan-vram-2000", lambda t: plan(t, "--vram", "2000"), "--vram 2000"),
    Case("plan-vram-bytes-with-gpu", lambda t: plan(t, "--gpu", "RTX 3060", "--vram", "1e10"), "gigabytes"),
    Case("plan-vram-mib", lambda t: plan(t, "--vram", "24576"), "gigabytes"),
    Case("plan-gpu-with-a-tab", lambda t: plan(t, "--gpu", "RTX\t4090"), "unknown GPU"),
    Case("plan-gpu-with-a-semicolon", lambda t: plan(t, "--gpu", "4090;rm -rf"), "unknown GPU"),
    Case("plan-gpu-cyrillic", lambda t: plan(t, "--gpu", "\u0420\u0422\u0425 4090"), "unknown GPU"),
    Case("plan-gpu-nul-like", lambda t: plan(t, "--gpu", "RTX 4090\u200b"), "unknown GPU"),
    Case("plan-network-lokr-with-algo-loha", lambda t: plan(t, "--network", "lokr", "--network-arg", "algo=loha"),
         "--network loha"),
    Case("plan-network-lora-with-algo-locon", lambda t: plan(t, "--network-arg", "algo=locon"), "--network locon"),
    Case("plan-optimizer-unknown-any-case", lambda t: plan(t, "--optimizer", "superadam"), "--optimizer"),
    Case("bench-sweep-key-twice-any-case", lambda t: bench(t, "--sweep", "Batch=1", "--sweep", "batch=2"),
         "swept twice"),
    Case("bench-sweep-precision-twice", lambda t: bench(t, "--sweep", "precision=no", "--sweep", "precision=bf16"),
         "swept twice"),
    Case("run-python-without-engine-missing-file", lambda t: run(t, "--python", str(t / "nope")), "--python"),
    Case("doctor-caption-extension-jpg", lambda t: ["autotune", "doctor", str(dataset(t)), "--caption-extension",
                                                    ".jpg"], "--caption-extension"),
    Case("doctor-caption-extension-png-no-dot", lambda t: ["autotune", "doctor", str(dataset(t)),
                                                           "--caption-extension", "png"], "--caption-extension"),
    Case("doctor-sdxl-resolution-65", lambda t: ["autotune", "doctor", str(dataset(t)), "--model", "builtin:tiny-sdxl",
                                                 "--resolution", "65"], "--resolution 65"),
    Case("doctor-sd3-resolution-70", lambda t: ["autotune", "doctor", str(dataset(t)), "--model", "builtin:tiny-sd3",
                                                "--resolution", "70"], "--resolution 70"),
    Case("report-html-over-a-dataset-image", lambda t: ["autotune", "report", str(run_folder(t)), "--html",
                                                        str(dataset(t) / "2_toy" / "img0.png")], "did not write"),
    Case("report-html-over-a-caption", lambda t: ["autotune", "report", str(run_folder(t)), "--html",
                                                  str(dataset(t) / "2_toy" / "img0.txt")], "did not write"),
    Case("report-html-over-the-plan-json", lambda t: ["autotune", "report", str(run_folder(t)), "--html",
                                                      str(t / "run" / "autotune_plan.json")], "did not write"),
    Case("report-html-over-a-symlinked-lora", lambda t: ["autotune", "report", str(run_folder(t)), "--html",
                                                         str(link_to(t / "r.html", t / "run" / "lora.safetensors"))],
         "did not write"),
    Case("doctor-html-over-a-config", lambda t: ["autotune", "doctor", str(dataset(t)), "--html",
                                                 str(config(t / "c"))], "did not write"),
    Case("doctor-html-is-the-dataset-folder-file", lambda t: ["autotune", "doctor", str(dataset(t)), "--html",
                                                              str(t / "data" / "index.html")], "inside the dataset"),
    Case("plan-out-dataset-with-trailing-slash", lambda t: plan(t, "--out", str(t / "data") + "/"),
         "inside the dataset"),
    Case("plan-out-into-the-dataset-by-dotdot", lambda t: plan(t, "--out", str(t / "x" / ".." / "data" / "o")),
         "inside the dataset"),
    Case("plan-out-into-the-dataset-by-a-link", lambda t: plan(t, "--out", str(subfolder_link(t))),
         "inside the dataset"),
    Case("plan-out-over-a-dataset-toml", lambda t: plan(t, "--out", str(folder_with(t, "dataset.toml"))),
         "autotune did not write"),
    Case("plan-out-over-decisions", lambda t: plan(t, "--out", str(folder_with(t, "logs/decisions.jsonl"))),
         "holds a run"),
    Case("plan-out-over-run-state", lambda t: plan(t, "--out", str(folder_with(t, "state/autotune_run.json"))),
         "holds a run"),
    Case("plan-out-over-a-lora", lambda t: plan(t, "--out", str(lora_like(folder_with(t) / "x.safetensors").parent)),
         "holds a run"),
    Case("plan-out-over-events", lambda t: plan(t, "--out", str(folder_with(t, "logs/events/done.json"))),
         "holds a run"),
    Case("plan-out-is-a-file", lambda t: plan(t, "--out", str(a_file(t / "f"))), "--out"),
    Case("run-out-into-the-dataset-by-a-link", lambda t: ["autotune", "run", str(dataset(t)), "--model", TINY, "--out",
                                                          str(subfolder_link(t))], "inside the dataset"),
    Case("run-out-is-the-dataset-by-dotdot", lambda t: ["autotune", "run", str(dataset(t)), "--model", TINY, "--out",
                                                        str(t / "data" / "2_toy" / "..")], "inside the dataset"),
    Case("inspect-diffusers-out-over-a-text-file", lambda t: ["autotune", "inspect", str(sd3_lora(t)),
                                                              "--diffusers-out", str(a_file(t / "c.safetensors"))],
         "did not write"),
    Case("inspect-diffusers-out-over-the-lora-by-a-link", lambda t: [
        "autotune", "inspect", str(sd3_lora(t)), "--diffusers-out", str(link_to(t / "l.safetensors",
                                                                               t / "lora.safetensors"))],
         "would overwrite the LoRA"),
    Case("inspect-diffusers-out-a-folder", lambda t: ["autotune", "inspect", str(sd3_lora(t)), "--diffusers-out",
                                                      str((t / "d.safetensors").mkdir() or t / "d.safetensors")],
         "is a folder"),
    Case("wizard-trigger-with-a-backslash", lambda t: ["autotune", "wizard", str(flat_folder(t)), "--model", TINY,
                                                       "--cpu", "--organise", "copy", "--trigger", "a\\b", "--yes",
                                                       "--no-start"], "--trigger"),
    Case("wizard-trigger-dotdot", lambda t: ["autotune", "wizard", str(flat_folder(t)), "--model", TINY, "--cpu",
                                             "--organise", "copy", "--trigger", "../up", "--yes", "--no-start"],
         "--trigger"),
    Case("engine-json-prompts-seed-float", lambda t: json_prompts(t, '[{"prompt": "a", "seed": 1.5}]'), "seed"),
    Case("engine-json-prompts-scale-string", lambda t: json_prompts(t, '[{"prompt": "a", "scale": "7"}]'), "scale"),
    Case("engine-json-prompts-negative-a-number", lambda t: json_prompts(t, '[{"prompt": "a", "negative_prompt": 5}]'),
         "negative_prompt"),
    Case("engine-toml-prompts-subset-numbers", lambda t: toml_prompts(t, "[prompt]\nsubset = [1, 2]"),
         "each prompt is a table"),
    Case("engine-toml-prompts-latin-1", lambda t: engine(t, sample_prompts=str(latin_1_toml(t / "p.toml")),
                                                         sample_every_n_steps=1), "not UTF-8"),
    Case("engine-lokr-factor-half", lambda t: lycoris(t, "algo=lokr", "factor=0.5"), "factor"),
    Case("engine-dylora-block-size-word", lambda t: lycoris(t, "algo=dylora", "block_size=big"), "block_size"),
    Case("engine-betas-nan", lambda t: opt(t, "betas=nan,0.9"), "betas"),
    Case("engine-betas-inf", lambda t: opt(t, "betas=0.9,inf"), "betas"),
    Case("engine-lion-beta-one", lambda t: opt(t, "betas=0.9,1.0", name="Lion"), "betas"),
    Case("plan-vram-1025", lambda t: plan(t, "--vram", "1025"), "gigabytes"),
    Case("plan-gpu-an-emoji", lambda t: plan(t, "--gpu", "\U0001F642"), "unknown GPU"),
    Case("plan-network-lokr-with-algo-loha-spaced", lambda t: plan(t, "--network", "lokr", "--network-arg",
                                                                   "algo= loha"), "--network loha"),
    Case("doctor-caption-extension-mp4", lambda t: ["autotune", "doctor", str(dataset(t)), "--caption-extension",
                                                    ".mp4"], "--caption-extension"),
    Case("doctor-caption-extension-bmp-upper", lambda t: ["autotune", "doctor", str(dataset(t)),
                                                          "--caption-extension", ".BMP"], "--caption-extension"),
    Case("report-html-over-a-script", lambda t: ["autotune", "report", str(run_folder(t)), "--html",
                                                 str(a_file(t / "run" / "musubi_train.sh"))], "did not write"),
    Case("run-out-is-the-dataset-with-a-slash", lambda t: ["autotune", "run", str(dataset(t)), "--model", TINY,
                                                           "--out", str(t / "data") + "/"], "inside the dataset"),
    Case("bench-sweep-resolution-twice", lambda t: bench(t, "--sweep", "resolution=64", "--sweep", "resolution=128"),
         "swept twice"),
    Case("plan-out-over-a-users-dataset-toml-and-config", lambda t: plan(t, "--out", str(folder_with(
        t, "config.toml", "dataset.toml"))), "autotune did not write"),
    Case("run-out-over-a-users-config", lambda t: ["autotune", "run", str(dataset(t)), "--model", TINY, "--out",
                                                   str(config(t / "mine").parent)], "autotune did not write"),
    Case("engine-min-timestep-above-max", lambda t: engine(t, min_timestep=600, max_timestep=500),
         "above max_timestep"),
    Case("engine-max-timestep-1001", lambda t: engine(t, max_timestep=1001), "max_timestep"),
    Case("engine-min-timestep-negative", lambda t: engine(t, min_timestep=-1), "min_timestep"),
    Case("doctor-html-over-a-lora", lambda t: ["autotune", "doctor", str(dataset(t)), "--html",
                                               str(lora_like(t / "l.safetensors"))], "did not write"),
]


def latin_1_toml(path: Path) -> Path:
    path.write_bytes('[prompt]\n[[prompt.subset]]\nprompt = "caf\xe9"\n'.encode("latin-1"))
    return path


def link_to(link: Path, target: Path) -> Path:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return link


def batch_zero(root: Path) -> Path:
    return text_file(root / "d.toml", f'[[datasets]]\nbatch_size = 0\n[[datasets.subsets]]\nimage_dir = '
                                      f'"{dataset(root) / "2_toy"}"\n')


def binary_text(path: Path) -> Path:
    path.write_bytes("a caf\xe9 --w 64 --h 64\n".encode("latin-1"))
    return path


# issue 48: engines come from the registry (autotune.launch.engines); families name their runtime
ISSUE_48 = [
    Case("run-engine-unknown-name", lambda t: run(t, "--engine", f"toy={t}"), "expected sd-scripts=PATH"),
    Case("run-engine-ours-by-name", lambda t: run(t, "--engine", f"autotune={t}"), "expected sd-scripts=PATH"),
    Case("run-engine-without-path", lambda t: run(t, "--engine", "sd-scripts="), "expected sd-scripts=PATH"),
    Case("run-sd-scripts-engine-on-a-musubi-family",
         lambda t: run(t, "--engine", f"sd-scripts={t}", model="builtin:z-image"), "not trained by sd-scripts"),
    Case("train-musubi-engine", lambda t: train(t, "--engine", f"musubi-tuner={t}"),
         "does not run a kohya config by itself"),
    Case("train-engine-unknown-name", lambda t: train(t, "--engine", f"toy={t}"), "expected sd-scripts=PATH"),
    # found by mypy: a config without a base model was a TypeError traceback in the engine
    Case("engine-config-without-a-model", lambda t: engine(t, pretrained_model_name_or_path=None),
         "pretrained_model_name_or_path: not given"),
]

CORPUS = (CLI + CONFIG + DATASETS + MODELS + LORAS + INTERRUPTIONS + REPORTS + MORE + ISSUE_47 + OWN_47
          + ISSUE_48)


def files_under(root: Path) -> set[str]:
    """Every file (not folder) under ``root``, symlinks not followed."""
    found = set()
    for folder, _dirs, files in os.walk(root):
        found.update(os.path.relpath(os.path.join(folder, f), root) for f in files)
    return found


def check_one_line(done: subprocess.CompletedProcess, code: int, needle: str) -> str:
    """Non-zero exit (the expected one), one non-empty stderr line with the needle, no traceback, no warning."""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == code, f"exit {done.returncode}\nstderr:\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr + done.stdout, done.stderr[-3000:]
    assert len(lines) == 1, f"{len(lines)} stderr lines:\n{done.stderr[-3000:]}"
    line = lines[0]
    assert line.startswith(("autotune", "train_network: ", "sdxl_train_network: ", "flux_train_network: ",
                            "sd3_train_network: ")), line
    assert needle in line, line
    assert not LIBRARY_WARNING.search(done.stderr + done.stdout), (done.stdout + done.stderr)[-2000:]
    return line


def test_a_broken_family_file_or_engine_package_is_one_line(tmp_path: Path):
    """Inputs that come by the environment (issue 48): a family file of ``SD_COMPAT_FAMILY_PATH`` that is not one,
    an engine package whose entry point does not load, an emulated card of no size; each is one line, nothing
    written."""
    families, site = tmp_path / "families", tmp_path / "site"
    families.mkdir()
    (families / "tiny-bad.json").write_text("{not json", encoding="utf-8")
    strangers = tmp_path / "strangers"  # a family trained by a trainer this version has no facts of
    strangers.mkdir()
    twin = json.loads((REPO / "sd_scripts_compat" / "data" / "families" / "tiny-sd15.json").read_text())
    (strangers / "tiny-axolotl.json").write_text(json.dumps({**twin, "name": "tiny-axolotl", "trainer": "axolotl"}))
    info = site / "broken_engine-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-engine\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[lora_autotune.engines]\nbroken = no_such_module:ENGINE\n")
    cases = [({"SD_COMPAT_FAMILY_PATH": str(families)}, plan(tmp_path, model="builtin:tiny-bad"),
              "tiny-bad.json: not a family file"),
             ({"SD_COMPAT_FAMILY_PATH": str(strangers)}, plan(tmp_path, model="builtin:tiny-axolotl"),
              "trainer 'axolotl' is not one of sd-scripts, musubi-tuner"),
             ({"PYTHONPATH": os.pathsep.join(filter(None, [str(site), ENV.get("PYTHONPATH")]))},
              run(tmp_path, "--engine", f"broken={tmp_path}"), "engine 'broken'"),
             ({"SD_COMPAT_EMULATED_CARD_MIB": "lots"}, train(tmp_path), "SD_COMPAT_EMULATED_CARD_MIB='lots'")]
    for extra, argv, needle in cases:
        before = files_under(tmp_path)
        done = subprocess.run([sys.executable, "-m", *argv], cwd=tmp_path, env={**ENV, **extra},
                              capture_output=True, text=True, timeout=300)
        check_one_line(done, USER_ERROR, needle)
        assert files_under(tmp_path) == before, sorted(files_under(tmp_path) - before)


def test_the_corpus_is_large_and_its_ids_unique():
    ids = [case.id for case in CORPUS]
    assert len(ids) == len(set(ids)) and len(ids) >= 60, len(ids)


@pytest.fixture(scope="module")
def forked():
    from fixtures.fork_server import ForkServer

    server = ForkServer(ENV)
    yield server
    server.close()


@pytest.mark.parametrize("case", CORPUS, ids=lambda case: case.id)
def test_hostile_input_is_one_line_no_traceback_no_output(case: Case, tmp_path: Path, forked):
    argv = case.build(tmp_path)
    before = files_under(tmp_path)
    done = forked.run(argv, cwd=tmp_path, env=ENV, timeout=300)
    check_one_line(done, case.code, case.needle)
    assert files_under(tmp_path) == before, sorted(files_under(tmp_path) - before)


def _wait_until_torch_is_loaded(pid: int, timeout: float = 120.0) -> None:
    """The engine is past Python's start and inside its own main (torch mapped), so our handlers are in."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text():
                return
        except OSError:
            return
        time.sleep(0.05)


def test_an_engine_error_in_autotune_run_is_shown_once_and_the_same_out_can_be_used_again(tmp_path: Path):
    """The doctor skipped, the engine itself refuses a truncated JPEG in the child: its one line reaches the user
    once, as `autotune run: error: ...`, after no library noise; nothing is left in --out, so the same command
    gives the same answer again (not "holds an earlier run")."""
    data, out = truncated_jpeg(tmp_path), tmp_path / "run"
    command = [sys.executable, "-m", "autotune", "run", str(data), "--model", TINY, "--out", str(out), "--epochs",
               "1", "--skip-doctor"]
    before = files_under(tmp_path)
    lines = []
    for _ in range(2):
        done = subprocess.run(command, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
        lines.append(check_one_line(done, USER_ERROR, "img1.jpg: cannot read image (the file is truncated)"))
        assert lines[-1].startswith("autotune run: error: ") and "train_network" not in lines[-1]
        assert done.stdout.count("img1.jpg") == 0  # not also among the decisions on stdout
        assert files_under(tmp_path) == before and not out.exists()
    assert lines[0] == lines[1]


@pytest.mark.long
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc to know the engine has started")
@pytest.mark.parametrize("phase", ["starting", "caching"])
@pytest.mark.parametrize(("number", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_before_training_is_one_line_and_leaves_nothing(number: int, code: int, phase: str,
                                                                     tmp_path: Path):
    """Ctrl-C / `docker stop` before the first step: nothing trained, nothing to save, one line, no output.
    "starting": as soon as torch is loaded (reading the config); "caching": inside the first latent-cache write
    (held open by the atomic-write test hook), so the half-written cache must vanish too."""
    argv = engine(tmp_path, max_train_steps=1000, cache_latents=True, cache_latents_to_disk=True)
    images = tmp_path / "data" / "2_toy"
    before = files_under(tmp_path)
    env = {**ENV, "SD_COMPAT_TEST_SAVE_PAUSE": "*.latents.safetensors:120"}
    child = subprocess.Popen([sys.executable, "-m", *argv], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    if phase == "starting":
        _wait_until_torch_is_loaded(child.pid)
    else:
        deadline = time.time() + 300
        while not [p for p in images.iterdir() if p.name.startswith(".")] and child.poll() is None:
            assert time.time() < deadline
            time.sleep(0.05)
    child.send_signal(number)
    stdout, stderr = child.communicate(timeout=300)
    line = check_one_line(subprocess.CompletedProcess(argv, child.returncode, stdout, stderr), code,
                          "before training started; nothing to save")
    assert signal.Signals(number).name in line
    assert files_under(tmp_path) == before  # no cache, no temp file, no state, no LoRA
