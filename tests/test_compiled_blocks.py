"""torch_compile: each repeated block compiled on its own, trained like eager, eager again when compiling fails.

Real compiles on this CPU with dynamo's ``aot_eager`` backend (dynamo traces each block with its LoRA modules,
AOTAutograd splits forward and backward; no code generation, so the test is quick and its numbers are eager's).
Inductor itself is measured in bench/, not here: its CPU compile takes minutes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixtures.engine_runs import run_engine

from sd_scripts_compat.network.lora_file import read_lora_file

ROOT = Path(__file__).resolve().parents[1]
DATASET = ROOT / "examples" / "dataset"


def config(tmp_path: Path, name: str, **overrides) -> dict:
    """tiny-sd15 at 128 px with buckets in steps of 32: the example images fall into several bucket sizes."""
    return {"pretrained_model_name_or_path": "builtin:tiny-sd15", "train_data_dir": str(DATASET),
            "output_dir": str(tmp_path / name), "output_name": "lora", "resolution": "128,128",
            "enable_bucket": True, "bucket_reso_steps": 32, "min_bucket_reso": 64, "max_bucket_reso": 256,
            "caption_extension": ".txt", "train_batch_size": 1, "max_train_steps": 6, "network_dim": 4,
            "network_alpha": 4, "learning_rate": 1e-3, "seed": 3, "cache_latents": True,
            "max_data_loader_n_workers": 0, **overrides}


def train(tmp_path: Path, name: str, **overrides) -> tuple[dict, dict, str]:
    events = tmp_path / f"{name}-events"
    done = run_engine("train_network", tmp_path, config(tmp_path, name, **overrides), "--autotune_events_dir",
                      str(events), name=f"{name}.toml")
    lora = read_lora_file(tmp_path / name / "lora.safetensors")[0]
    return json.loads((events / "done.json").read_text()), lora, done.stderr


def assert_trained_alike(compiled: dict, eager: dict) -> None:
    """Each trained tensor within 1% of eager's (relative L2). Not element by element: compiled graphs may sum in
    another order (CI's AVX-512 kernels did), and AdamW turns a rounding difference in a near-zero gradient into a
    whole learning-rate step for that one element."""
    assert eager.keys() == compiled.keys()
    for key, tensor in eager.items():
        assert tensor.norm() > 0, key
        assert (compiled[key] - tensor).norm() <= 0.01 * tensor.norm(), key


@pytest.mark.slow
def test_compiled_checkpointed_blocks_train_as_eager_across_bucket_sizes_without_a_compile_per_size(tmp_path):
    from sd_scripts_compat.facts.families import get_family
    from sd_scripts_compat.models.build import build_modules
    from sd_scripts_compat.training.compiled_blocks import repeated_blocks

    _, eager, _ = train(tmp_path, "eager")
    # compiled and checkpointed at once: the blocks' recompute in backward runs the compiled code too
    done, compiled, stderr = train(tmp_path, "compiled", torch_compile=True, dynamo_backend="aot_eager",
                                   gradient_checkpointing=True)
    blocks = len(repeated_blocks(build_modules(get_family("tiny-sd15"), device="meta", seed=None).unet))
    summary = done["torch_compile"]
    assert summary["backend"] == "aot_eager" and summary["failure"] is None and summary["blocks"] == blocks
    # six steps over several bucket sizes: each block compiles once, then at most once more with dynamic sizes
    assert blocks <= summary["graphs"] <= 2 * blocks, summary
    assert "warning" not in stderr, stderr
    assert_trained_alike(compiled, eager)


@pytest.mark.long
@pytest.mark.parametrize(("backend", "when"), [("onnxrt", "not a backend this torch has: refused at setup"),
                                               ("tvm", "registered, but tvm is not installed: fails at first call")])
def test_a_backend_that_cannot_compile_falls_back_to_eager_with_one_line(tmp_path, backend, when):
    done, _, stderr = train(tmp_path, "fallback", torch_compile=True, dynamo_backend=backend, max_train_steps=2)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"torch_compile ({backend}) failed on " in lines[0], (when, stderr)
    assert "training continues eager" in lines[0]
    assert done["steps"] == 2 and done["torch_compile"]["failure"], done["torch_compile"]


FLUX = {"pretrained_model_name_or_path": "builtin:tiny-flux", "train_data_dir": str(DATASET), "output_name": "lora",
        "resolution": "64,64", "caption_extension": ".txt", "train_batch_size": 2, "max_train_steps": 4,
        "network_dim": 4, "network_alpha": 4, "learning_rate": 1e-3, "seed": 3, "max_data_loader_n_workers": 0,
        "network_train_unet_only": True, "t5xxl_max_token_length": 16, "model_prediction_type": "raw",
        "timestep_sampling": "shift", "discrete_flow_shift": 3.0, "guidance_scale": 1.0, "blocks_to_swap": 1}


@pytest.mark.slow
def test_compiled_flux_blocks_with_block_swap_train_as_eager(tmp_path):
    """FLUX.1's double and single transformer blocks compiled one by one, one of them swapped to the host."""
    loras = {}
    for name, extra in (("eager", {}), ("compiled", {"torch_compile": True, "dynamo_backend": "aot_eager"})):
        events = tmp_path / f"{name}-events"
        run_engine("flux_train_network", tmp_path, {**FLUX, "output_dir": str(tmp_path / name), **extra},
                   "--autotune_events_dir", str(events), name=f"{name}.toml")
        loras[name] = read_lora_file(tmp_path / name / "lora.safetensors")[0]
        done = json.loads((events / "done.json").read_text())
    summary = done["torch_compile"]
    assert summary["failure"] is None and summary["blocks"] >= 2 and summary["graphs"] >= 2, summary
    assert_trained_alike(loras["compiled"], loras["eager"])


# a block of our own (dynamo leaves torch's own modules, such as Linear, to eager), for the child scripts below
BLOCK = """
class Block(torch.nn.Module):
    def __init__(self, a, b):
        super().__init__()
        self.linear = torch.nn.Linear(a, b)
    def forward(self, x):
        return torch.nn.functional.gelu(self.linear(x))
"""

COMPILE_TWO_BLOCKS = """
import json, sys, torch
from pathlib import Path
from sd_scripts_compat.training.compiled_blocks import compile_blocks, report_compiles
from sd_scripts_compat.training.phase_report import PhaseReporter
events, seen = Path(sys.argv[1]), []
reporter = PhaseReporter(events)
reporter.enter("training")
def listen(begun):
    reporter.compiling(begun)
    seen.append(json.loads((events / "phase.json").read_text())["phase"])
report_compiles(listen)
""" + BLOCK + """
model = torch.nn.Module()
model.down_blocks = torch.nn.ModuleList([Block(4, 8), Block(8, 2)])
compiled = compile_blocks(model, "aot_eager")
x = torch.randn(3, 4)
for block in model.down_blocks:
    x = block(x)
x.sum().backward()
print(json.dumps({"seen": seen, "blocks": len(compiled.blocks)}))
"""


def test_the_engine_says_compiling_while_dynamo_compiles_then_training_again(tmp_path):
    """phase.json reads "compiling" for as long as dynamo compiles a block: the watchdog's stall limit for a
    training step (ten steps, at least a minute) does not cut a compile short (in a child: dynamo's compile
    callbacks are the process's)."""
    import subprocess
    import sys

    from autotune.recovery.stall import stall_limit

    done = subprocess.run([sys.executable, "-c", COMPILE_TWO_BLOCKS, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    seen = result["seen"]
    # each compile (a first one per block, recompiles for the second block's sizes) is "compiling" until it ends
    assert result["blocks"] == 2 and len(seen) >= 4 and seen == ["compiling", "training"] * (len(seen) // 2), seen
    assert stall_limit({"phase": "compiling"}, {"it_per_s": 10.0}, 600.0) == 600.0
    assert stall_limit({"phase": "training"}, {"it_per_s": 10.0}, 600.0) == 60.0


TWELVE_BLOCKS_OF_ONE_CLASS = """
import json, torch
from torch._dynamo.utils import counters
from sd_scripts_compat.training.compiled_blocks import compile_blocks
""" + BLOCK + """
model = torch.nn.Module()
model.down_blocks = torch.nn.ModuleList([Block(4 + i, 5 + i) for i in range(12)])
compiled = compile_blocks(model, "eager")
for i, block in enumerate(model.down_blocks):
    block(torch.randn(2, 4 + i))
print(json.dumps({"graphs": counters["stats"]["unique_graphs"], "failure": compiled.failure}))
"""


def test_more_blocks_of_one_class_than_dynamos_default_limit_all_compile_quietly():
    """Blocks of one class share their forward's code object, and dynamo keeps 8 compiled versions per code object
    by default: without a raised limit the 9th of these twelve differently sized blocks ran eager with a warning."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", TWELVE_BLOCKS_OF_ONE_CLASS], capture_output=True, text=True,
                          timeout=300, check=True)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"graphs": 12, "failure": None}
    assert done.stderr.strip() == "", done.stderr
