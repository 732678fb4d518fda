"""Issue 22's edge checks that need more than the hostile corpus' one-line rule: the OOM handler on a bare
``MemoryError()`` (no message), and what the range table refuses (non-finite numbers, seeds numpy cannot take)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sd_scripts_compat.config.bounds import bound_problem
from sd_scripts_compat.facts.contract import error_summary
from tests.test_train_engine import ENV, ROOT, base_config, write_config


def test_error_summary_never_fails():
    assert error_summary(MemoryError()) == "MemoryError"
    assert error_summary(RuntimeError("\n\n")) == "RuntimeError"
    assert error_summary(RuntimeError("CUDA out of memory.\nTried to allocate")) == "CUDA out of memory."


@pytest.mark.parametrize(("name", "value", "said"), [
    ("learning_rate", float("nan"), "finite"), ("max_grad_norm", float("inf"), "finite"),
    ("seed", -1, "0 or more"), ("seed", 2**64, f"at most {2**32 - 1}"), ("validation_seed", 2**32, "at most"),
])
def test_the_range_table_refuses(name, value, said):
    assert said in bound_problem(name, value)


@pytest.mark.long
def test_a_bare_memory_error_is_an_oom_not_a_crash(tmp_path):
    events = tmp_path / "events"
    config = write_config(tmp_path / "config.toml", base_config(tmp_path, max_train_steps=3))
    result = subprocess.run([sys.executable, "-m", "sd_scripts_compat.train_network", "--config_file", str(config),
                             "--autotune_events_dir", str(events)], capture_output=True, text=True, cwd=ROOT,
                            env={**ENV, "SD_COMPAT_INJECT_OOM": "bare_step=1"}, timeout=600)
    assert result.returncode == 87, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "IndexError" not in result.stderr
    oom = json.loads((events / "oom.json").read_text())
    assert oom["step"] == 1 and oom["message"] == "MemoryError"
    assert "out of memory at step 1: MemoryError" in result.stderr


def test_sample_sizes_are_rounded_as_sd_scripts_renders_them():
    from sd_scripts_compat.facts.sample_prompts import SamplePrompt, parse_prompt_line

    with pytest.warns(UserWarning, match="500x70 rendered at 496x64"):
        sample = parse_prompt_line("a toy --w 500 --h 70", SamplePrompt(prompt=""))
    assert (sample.width, sample.height) == (496, 64)
    assert (parse_prompt_line("a toy --w 512 --h 48", SamplePrompt(prompt="")).height) == 64


def test_a_bad_optimizer_argument_is_refused_before_anything_loads(tmp_path):
    from sd_scripts_compat.facts.errors import UserError
    from sd_scripts_compat.training.optim import check_optimizer_settings

    with pytest.raises(UserError, match="optimizer_args for AdamW"):
        check_optimizer_settings("AdamW", 1e-4, {"betas": (2.0, 0.9)})
    with pytest.raises(UserError, match="weight_decayy"):
        check_optimizer_settings("AdamW", 1e-4, {"weight_decayy": 0.1})
    check_optimizer_settings("Lion", 1e-4, {"betas": (0.9, 0.99)})


@pytest.mark.long
def test_the_engines_own_warnings_are_one_line_each(tmp_path):
    """A warning of ours reads like the engine's errors (``train_network: warning: ...``), not as Python's
    ``file:line: UserWarning`` plus a source line."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(ROOT / "examples" / "dataset", data)
    config = write_config(tmp_path / "config.toml", base_config(tmp_path, train_data_dir=str(data),
                                                                caption_extension=".caption", max_train_steps=1))
    result = subprocess.run([sys.executable, "-m", "sd_scripts_compat.train_network", "--config_file", str(config)],
                            capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    said = [line for line in result.stderr.splitlines() if "images captioned" in line]
    assert said and all(line.startswith("train_network: warning: ") for line in said), result.stderr[-2000:]
    assert "UserWarning" not in result.stderr and "warnings.warn" not in result.stderr
