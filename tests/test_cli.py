"""The ``autotune`` command line, run as real subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.cli import COMMANDS
from autotune.hardware.probe import SystemProbe

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "120"}


def autotune(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autotune", *args], capture_output=True, text=True, timeout=120,
                          env=ENV, cwd=cwd, check=False)


def test_help_lists_every_subcommand():
    done = autotune("--help")
    assert done.returncode == 0, done.stderr
    for name, _, _ in COMMANDS:
        assert name in done.stdout
    assert "probe" in done.stdout


def test_help_names_every_family_and_keeps_examples_one_a_line():
    from sd_scripts_compat.facts.families import family_names, get_family

    top = autotune("--help").stdout
    for name in family_names():
        assert name in top and (get_family(name).tiny or get_family(name).description.split(" (")[0] in top)
    assert "\n  autotune plan DATASET --model builtin:flux-dev --vram 16\n" in top
    bench = autotune("bench", "--help").stdout
    assert "\n    autotune bench DATASET --model M --sweep batch=1,2,4,8        # one run per micro-batch\n" in bench


def test_plan_help_lists_every_builtin_model_and_card_whole():
    from autotune.hardware.gpu_catalog import load_catalog
    from sd_scripts_compat.facts.families import family_names

    text = autotune("plan", "--help").stdout
    lines = text[text.index("built-in models"):].splitlines()
    names = {name.strip() for line in lines for name in line.split(",")}
    assert {f"builtin:{name}" for name in family_names()} <= names
    assert {spec.name for spec in load_catalog()} <= names  # "RTX 4060 Ti 16GB" never split over two lines


def test_console_script_entry_point():
    script = Path(sys.executable).parent / ("autotune.exe" if os.name == "nt" else "autotune")
    if not script.exists():
        pytest.skip("package not installed with pip install -e . in this environment")
    done = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60, env=ENV,
                          check=False)
    assert done.returncode == 0 and done.stdout.startswith("lora-autotune ")


def test_probe_json_is_one_object(tmp_path):
    done = autotune("probe", "--json", "--output-dir", str(tmp_path / "not-yet"))
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)  # the whole of stdout is one JSON object
    probe = SystemProbe.from_json(done.stdout)
    assert probe.to_json() == json.dumps(data, indent=2)
    assert probe.disk.checked_path == str(tmp_path)
    assert probe.cpu.logical_cores == os.cpu_count()
    if not probe.cuda_gpu_found:
        assert probe.cuda_reason
    assert "Traceback" not in done.stderr


def test_probe_human_view(tmp_path):
    done = autotune("probe", "--output-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "System" in done.stdout and "Libraries" in done.stdout
    data = json.loads(autotune("probe", "--json").stdout)
    if not data["cuda_gpu_found"]:
        assert "no CUDA GPU found" in done.stdout


def test_probe_assumed_gpu():
    done = autotune("probe", "--gpu", "RTX 3060", "--json")
    assert done.returncode == 0, done.stderr
    gpu = json.loads(done.stdout)["gpus"][0]
    assert gpu["catalog_name"] == "RTX 3060 12GB" and gpu["source"] == "catalog"
    assert gpu["fp16_tensor_tflops"] == 25.5 and gpu["compute_capability"] == "8.6"
    human = autotune("probe", "--gpu", "4060 Ti 16GB")
    assert human.returncode == 0 and "RTX 4060 Ti 16GB" in human.stdout and "assumed" in human.stdout


def test_probe_unknown_gpu_is_one_line_exit_2():
    done = autotune("probe", "--gpu", "nonsense")
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autotune probe: error: unknown GPU 'nonsense'")
    near = autotune("probe", "--gpu", "4090x")
    assert near.returncode == 2 and "RTX 4090" in near.stderr and len(near.stderr.strip().splitlines()) == 1
