"""``fsdp`` (issue 53): the frozen denoiser sharded across processes with FSDP2, on two CPU processes over gloo
(accelerate's launcher, as users launch several GPUs): the same LoRA as the unsharded two-process run from the same
seed, and each process holds half the denoiser's weights. Real runs of the engine on tiny models; no GPU here."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import toml
import torch

from autotune.recovery.engine import free_port
from autotune.recovery.stall import TEST_TRAINING_FLOOR_ENV
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.network.lora_file import read_lora_file
from sd_scripts_compat.training.sharding import check_sharding

ROOT = Path(__file__).resolve().parents[1]
DATASET = ROOT / "examples" / "dataset"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}

FLUX = {"pretrained_model_name_or_path": "builtin:tiny-flux", "t5xxl_max_token_length": 16,
        "model_prediction_type": "raw", "timestep_sampling": "shift", "discrete_flow_shift": 3.0,
        "guidance_scale": 1.0}
SDXL = {"pretrained_model_name_or_path": "builtin:tiny-sdxl"}
MODELS = {"tiny-flux": ("flux_train_network", FLUX), "tiny-sdxl": ("sdxl_train_network", SDXL)}


def _config(tmp: Path, name: str, model: dict, **extra) -> Path:
    values = {**model, "train_data_dir": str(DATASET), "output_dir": str(tmp / name), "output_name": "lora",
              "resolution": "64,64", "caption_extension": ".txt", "train_batch_size": 1, "max_train_steps": 4,
              "network_dim": 4, "network_alpha": 4, "learning_rate": 1e-2, "seed": 3,
              "max_data_loader_n_workers": 0, "network_train_unet_only": True, "cache_latents": True,
              "mixed_precision": "no", **extra}
    path = tmp / f"{name}.toml"
    path.write_text(toml.dumps(values), encoding="utf-8")
    return path


def _command(script: str, config: Path, *extra: str, processes: int = 2) -> list[str]:
    """``accelerate launch --multi_gpu``: without CUDA the engine's Accelerator(cpu=True) runs the processes on
    gloo."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()),  # two tests at once (-n 2) must not share accelerate's 29500
            "-m", f"sd_scripts_compat.{script}", "--config_file", str(config), *extra]


def _launch(script: str, config: Path, *extra: str, processes: int = 2) -> subprocess.CompletedProcess:
    return subprocess.run(_command(script, config, *extra, processes=processes), capture_output=True, text=True,
                          cwd=ROOT, env=ENV, timeout=900)


@pytest.mark.long
@pytest.mark.parametrize(("model", "strategy", "extra"), [
    pytest.param("tiny-flux", "full_shard", {}, id="flux"),
    pytest.param("tiny-sdxl", "full_shard", {}, marks=pytest.mark.slow, id="sdxl"),
    pytest.param("tiny-flux", "shard_grad_op", {"gradient_checkpointing": True}, marks=pytest.mark.slow,
                 id="flux-shard_grad_op-checkpointing"),
    pytest.param("tiny-flux", "full_shard", {"fsdp_offload_params": True}, marks=pytest.mark.slow, id="flux-offload"),
    pytest.param("tiny-flux", "full_shard", {"fp8_base": True}, marks=pytest.mark.slow, id="flux-fp8"),
    pytest.param("tiny-sdxl", "full_shard", {"gradient_checkpointing": True}, marks=pytest.mark.slow,
                 id="sdxl-checkpointing")])
def test_a_sharded_run_writes_the_lora_of_the_unsharded_run(tmp_path, model, strategy, extra):
    """(``fsdp_offload_params`` on a CPU runs FSDP2's offload path with the host as the card: the copies are
    no-ops, the result must still be the unsharded run's.)"""
    script, values = MODELS[model]
    both = {k: v for k, v in extra.items() if not k.startswith("fsdp_")}  # fp8_base: both runs in float8
    plain = _launch(script, _config(tmp_path, "plain", values, **both))
    assert plain.returncode == 0, plain.stderr[-3000:]
    sharded = _launch(script, _config(tmp_path, "sharded", values, fsdp=strategy, **extra))
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    assert not sharded.stderr.strip(), sharded.stderr[-3000:]  # no library noise (FSDP2's, the profiler's)
    said = re.search(rf"fsdp {strategy}: .* sharded across 2 processes .*: each holds ([\d.]+) of its ([\d.]+) MiB"
                     + (" of weights in host RAM" if extra.get("fsdp_offload_params") else ""), sharded.stdout)
    assert said, sharded.stdout[-2000:]
    held, whole = float(said[1]), float(said[2])
    assert 0.45 * whole <= held <= 0.55 * whole  # half the weights each (a dimension that does not split pads)
    one, meta_one = read_lora_file(tmp_path / "plain" / "lora.safetensors")
    two, meta_two = read_lora_file(tmp_path / "sharded" / "lora.safetensors")
    assert list(one) == list(two) and meta_one["ss_steps"] == meta_two["ss_steps"] == "4"
    for key in one:  # the layout of a one-process file, the values of the unsharded run
        assert one[key].shape == two[key].shape and one[key].dtype == two[key].dtype
        torch.testing.assert_close(two[key], one[key], rtol=1e-3, atol=1e-4)  # measured: flux 0, sdxl 2.7e-5
    assert any(v.abs().sum() > 0 for k, v in two.items() if "lora_up" in k)  # it trained
    assert sorted(p.name for p in (tmp_path / "sharded").iterdir()) == ["lora.safetensors"]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "extra"), [("tiny-flux", {}), ("tiny-sdxl", {}), ("tiny-flux", {"fp8_base": True}),
                                             ("tiny-flux", {"shard_optimizer_state": True})],
                         ids=["flux", "sdxl", "flux-fp8", "flux-state-split"])
def test_four_processes_sharded_in_two_groups_of_two_write_the_lora_of_the_unsharded_run(tmp_path, model, extra):
    """``hybrid_shard`` with ``fsdp_shard_size = 2`` on four processes: each holds half the weights (its group's
    share), gathers within its group, and the LoRA is the unsharded four-process run's (with ``fp8_base`` both
    runs store the frozen weights in float8, the shares and gathers too; with ``shard_optimizer_state`` both split
    the optimizer's state across all four, whatever the groups)."""
    script, values = MODELS[model]
    plain = _launch(script, _config(tmp_path, "plain", values, **extra), processes=4)
    assert plain.returncode == 0, plain.stderr[-3000:]
    hybrid = _launch(script, _config(tmp_path, "hybrid", values, fsdp="hybrid_shard", fsdp_shard_size=2, **extra),
                     processes=4)
    assert hybrid.returncode == 0, hybrid.stderr[-3000:]
    assert not hybrid.stderr.strip(), hybrid.stderr[-3000:]
    said = re.search(r"fsdp hybrid_shard: .* sharded across 2 processes in each of 2 groups .*: each holds "
                     r"([\d.]+) of its ([\d.]+) MiB", hybrid.stdout)
    assert said, hybrid.stdout[-2000:]
    assert 0.45 * float(said[2]) <= float(said[1]) <= 0.55 * float(said[2])
    one = read_lora_file(tmp_path / "plain" / "lora.safetensors")[0]
    two = read_lora_file(tmp_path / "hybrid" / "lora.safetensors")[0]
    assert list(one) == list(two)
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-3, atol=1e-4)
    assert any(v.abs().sum() > 0 for k, v in two.items() if "lora_up" in k)


@pytest.mark.slow
def test_a_killed_sharded_run_resumes_at_its_saved_step_with_the_straight_runs_lora(tmp_path):
    """Both processes killed (SIGKILL to the launcher's group) while step 3 hangs, after the state of step 2 was
    saved; the sharded run resumed from that state ends with the LoRA of a straight sharded run, bit for bit.
    The hang is the engine's injected freeze (its marker file says it began): no clock decides when to kill."""
    script, values = MODELS["tiny-flux"]
    straight = _launch(script, _config(tmp_path, "straight", values, fsdp="full_shard"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = _config(tmp_path, "killed", values, fsdp="full_shard", save_every_n_steps=2, save_state=True)
    child = subprocess.Popen(_command(script, killed), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             env={**ENV, "SD_COMPAT_INJECT_FREEZE": "step=2"}, start_new_session=True)
    marker = tmp_path / "killed" / "injected-freeze-step2"
    try:
        while not marker.exists():
            assert child.poll() is None, child.stderr.read().decode()[-3000:] if child.stderr else ""
            time.sleep(0.2)
    finally:  # the launcher's group, and each rank: the launcher starts them in sessions of their own
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        for pid in _engine_processes(tmp_path):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    state = tmp_path / "killed" / "lora-step00000002-state"
    assert state.is_dir() and not (tmp_path / "killed" / "lora.safetensors").exists()
    resumed = _launch(script, _config(tmp_path, "resumed", values, fsdp="full_shard"), "--resume", str(state))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at step 2" in resumed.stdout
    one = read_lora_file(tmp_path / "straight" / "lora.safetensors")[0]
    two = read_lora_file(tmp_path / "resumed" / "lora.safetensors")[0]
    assert list(one) == list(two) and all(torch.equal(one[k], two[k]) for k in one)
    assert not _engine_processes(tmp_path)


@pytest.mark.parametrize(("strategy", "kw", "said"), [
    ("zero3", {}, "one of full_shard, shard_grad_op, hybrid_shard"),
    ("hybrid_shard", {"world": 4}, "fsdp_shard_size = None is not a size of group .* 4 processes into several: one "
                                   "of 2"),
    ("hybrid_shard", {"world": 6, "shard_size": 4}, "6 processes into several: one of 2, 3"),
    ("hybrid_shard", {"world": 4, "shard_size": 4}, "one of 2"),
    ("hybrid_shard", {"shard_size": 2}, "none fits 2 processes .*use full_shard"),
    ("full_shard", {"world": 4, "shard_size": 2}, "fsdp_shard_size = 2: it sizes the groups of fsdp = "
                                                  "\"hybrid_shard\""),
    (None, {"world": 4, "shard_size": 2}, "fsdp_shard_size = 2: it sizes the groups"),
    ("full_shard", {"world": 1}, "sharding needs several processes"),
    ("full_shard", {"blocks_to_swap": 4}, "blocks_to_swap does not combine with sharding"),
    ("full_shard", {"compiled": True}, "torch_compile does not combine"),
])
def test_a_strategy_this_run_cannot_use_is_one_line(strategy, kw, said):
    args = {"world": 2, "blocks_to_swap": 0, "compiled": False, **kw}
    with pytest.raises(UserError, match=said):
        check_sharding(strategy, **args)
    check_sharding(None, **{**args, "shard_size": None})  # unsharded: nothing to check


@pytest.mark.parametrize(("world", "size"), [(4, 2), (6, 3), (8, 4), (8, 2)])
def test_hybrid_shard_takes_a_group_size_that_divides_the_processes_into_several(world, size):
    check_sharding("hybrid_shard", world=world, blocks_to_swap=0, compiled=False, shard_size=size)
    check_sharding("full_shard", world=world, blocks_to_swap=0, compiled=False, shard_size=0)  # 0: every process


def test_offloading_without_sharding_is_one_line():
    with pytest.raises(UserError, match="fsdp_offload_params: it offloads the shares of a sharded denoiser"):
        check_sharding(None, world=2, blocks_to_swap=0, compiled=False, offload=True)


def test_one_process_with_fsdp_is_refused_before_the_model_loads(tmp_path):
    config = _config(tmp_path, "one", FLUX, fsdp="full_shard")
    done = subprocess.run([sys.executable, "-m", "sd_scripts_compat.flux_train_network", "--config_file",
                           str(config)], capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300)
    assert done.returncode == 2 and "sharding needs several processes" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "one").exists()


# ---- several processes under the watchdog (CompatEngine(processes=2): accelerate's launcher, gloo) ----------


def _supervised(tmp: Path, env_extra: dict[str, str], **config_extra):
    from autotune.recovery.engine import CompatEngine
    from autotune.recovery.ladder import LadderLimits, memory_predictor
    from autotune.recovery.watchdog import Job, supervise
    from sd_scripts_compat.config.resolved_run import settings_from_files
    from sd_scripts_compat.facts.families import get_family

    config = _config(tmp, "run", FLUX, fsdp="full_shard", train_batch_size=2, max_train_steps=6,
                     save_every_n_steps=1, save_state=True, **config_extra)
    env = {**ENV, **env_extra}
    settings = settings_from_files(config, None, script="flux_train_network").settings
    job = Job(config_path=config, output_dir=tmp / "run", settings=settings,
              limits=LadderLimits(budget_mib=1e6, min_resolution=64, resolution_step=64),
              predict=memory_predictor(get_family("tiny-flux"), cuda=False), env=env, echo=False,
              train_output_dir=tmp / "run", engine=CompatEngine.for_module(
                  "sd_scripts_compat.flux_train_network", save_state_every_s=3600, processes=2))
    return job, supervise(job)


@pytest.mark.long
@pytest.mark.parametrize(("fault", "outcome", "said"), [
    ("SD_COMPAT_INJECT_OOM", "oom", "injected by SD_COMPAT_INJECT_OOM"),
    pytest.param("SD_COMPAT_INJECT_KILL", "os_kill", "process 1 of the run killed by SIGKILL", marks=pytest.mark.slow),
])
def test_one_process_failing_stops_the_others_and_the_run_resumes_at_its_saved_step(tmp_path, fault, outcome, said):
    """Process 1 of 2 runs out of memory (or is killed) as step 4 begins: process 0 stops where the collective
    failed (one line), the watchdog reads the outcome from oom.json (or the launcher's account of the killed
    process), steps down and resumes both processes from the state of step 3; the run ends at step 6."""
    job, result = _supervised(tmp_path, {fault: "step=3,rank=1"})
    assert result.ok, result.message
    first = result.retries[0]
    assert first["failure"] == outcome and said in first["message"]
    assert first["resume_step"] == 3 and first["steps_lost"] == 0  # the state of step 3, saved before it began
    assert first["changes"]["train_batch_size"] == [2, 1]  # stepped down, the effective batch kept
    assert read_lora_file(tmp_path / "run" / "lora.safetensors")[1]["ss_steps"] == "6"
    report = subprocess.run([sys.executable, "-m", "autotune", "report", str(tmp_path / "run")], capture_output=True,
                            text=True, cwd=ROOT, env=ENV, timeout=300)
    assert report.returncode == 0, report.stderr
    text = " ".join(report.stdout.split())  # wrapped to the terminal
    assert re.search(r"peak memory per process: 0: [\d.]+ GiB, 1: [\d.]+ GiB", text), report.stdout
    # the collectives of step 5 (the resumed attempt's third), each process's own gloo time
    assert re.search(r"communication \(one profiled step, gloo\): 0: [\d.]+ s \(\d+% of a step\), "
                     r"1: [\d.]+ s \(\d+% of a step\)", text), report.stdout


@pytest.mark.slow
def test_a_collective_that_times_out_is_named_with_its_fix_and_the_run_resumes_with_the_same_settings(tmp_path,
                                                                                                    monkeypatch):
    """Process 1 hangs as step 2 begins (the engine's injected freeze, once); process 0 waits in the next collective
    until ``ddp_timeout`` (sd-scripts' option, 1 minute here) runs out: gloo's timeout, comm.json, the outcome
    comm_timeout with its fix; the watchdog resumes both processes from the state of step 2 with the same settings,
    to step 6. The stall detector's floor is raised to 5 minutes so that gloo's timeout, not it, decides."""
    monkeypatch.setenv(TEST_TRAINING_FLOOR_ENV, "300")  # the watchdog's stall floor (read in this process)
    job, result = _supervised(tmp_path, {"SD_COMPAT_INJECT_FREEZE": "step=2,rank=1"}, ddp_timeout=1)
    assert result.ok, result.message
    first = result.retries[0]
    assert first["failure"] == "comm_timeout", first
    assert "Timed out waiting 60000ms" in first["message"]  # gloo's own words, with ddp_timeout's 60 s
    decisions = (tmp_path / "run" / "logs" / "decisions.log").read_text(encoding="utf-8")
    assert "comm_timeout: attempt 0 failed" in decisions and "raise ddp_timeout (minutes)" in decisions
    assert first["resume_step"] == 2 and not first["changes"]
    assert read_lora_file(tmp_path / "run" / "lora.safetensors")[1]["ss_steps"] == "6"
    assert not _engine_processes(tmp_path)


@pytest.mark.slow
def test_a_stalled_run_of_several_processes_leaves_no_rank_behind(tmp_path, monkeypatch):
    """Process 1 hangs (it ignores SIGTERM: it sleeps in the injected freeze) and the stall detector stops the run
    (its floor at 5 s): the launcher starts each rank in a session of its own, so the watchdog signals every
    process it saw under the launcher, and SIGKILLs any left once the launcher is gone; the hung rank would
    otherwise keep its card's memory from the resumed run."""
    monkeypatch.setenv(TEST_TRAINING_FLOOR_ENV, "5")  # the watchdog's stall floor (read in this process)
    job, result = _supervised(tmp_path, {"SD_COMPAT_INJECT_FREEZE": "step=2,rank=1"})
    assert result.ok, result.message
    assert result.retries[0]["failure"] == "stall"
    assert not _engine_processes(tmp_path)


def _engine_processes(tmp: Path) -> list[int]:
    """Processes still running whose command line names this test's folder."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if any(str(tmp) in part for part in proc.info["cmdline"] or []):
            found.append(proc.info["pid"])
    return found


# ---- loading in turn (training.sharding.in_turn): two processes over gloo -------------------------------------

TURNS = """
import os, sys
from pathlib import Path
import torch.distributed as dist
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.training.sharding import in_turn

rank, log, refuse = int(os.environ["RANK"]), Path(sys.argv[1]), sys.argv[2]

def work():
    seen = log.read_text() if log.exists() else ""
    with log.open("a") as out:
        out.write(f"start {rank} saw {sum(line.startswith('end') for line in seen.splitlines())} ends\\n")
    if refuse == str(rank):
        raise UserError(f"model.safetensors: unreadable in process {rank}; download it again")
    with log.open("a") as out:
        out.write(f"end {rank}\\n")
    return rank

dist.init_process_group("gloo")
try:
    print("returned", in_turn(2, rank, work))
except UserError as error:
    print("refused:", error, error.exit_code)
finally:
    dist.destroy_process_group()
"""


def _two_turns(tmp: Path, refuse: str) -> list[str]:
    env = {**ENV, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    log = tmp / "turns.log"
    children = [subprocess.Popen([sys.executable, "-c", TURNS, str(log), refuse], cwd=ROOT, text=True,
                                 env={**env, "RANK": str(rank)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                for rank in (0, 1)]
    said = [child.communicate(timeout=300) for child in children]
    assert all(child.returncode == 0 for child in children), [err[-2000:] for _, err in said]
    return [out.strip() for out, _ in said]


def test_the_processes_load_in_turn_each_beginning_after_the_one_before_it_ended(tmp_path):
    """Process 1's load begins only once process 0's has ended (it sees that end in the log when it starts):
    the machine's RAM holds one whole denoiser at a time. No clock: the collective orders them."""
    assert _two_turns(tmp_path, refuse="none") == ["returned 0", "returned 1"]
    assert (tmp_path / "turns.log").read_text().splitlines() == [
        "start 0 saw 0 ends", "end 0", "start 1 saw 1 ends", "end 1"]


def test_a_process_refused_in_its_turn_stops_every_process_with_its_line_and_no_later_turn_begins(tmp_path):
    line = "refused: model.safetensors: unreadable in process 0; download it again 2"
    assert _two_turns(tmp_path, refuse="0") == [line, line]
    assert (tmp_path / "turns.log").read_text().splitlines() == ["start 0 saw 0 ends"]


def test_a_refusal_in_a_later_turn_reaches_the_process_that_loaded_already(tmp_path):
    line = "refused: model.safetensors: unreadable in process 1; download it again 2"
    assert _two_turns(tmp_path, refuse="1") == [line, line]
    assert (tmp_path / "turns.log").read_text().splitlines() == ["start 0 saw 0 ends", "end 0",
                                                                  "start 1 saw 1 ends"]


@pytest.mark.long
def test_a_sharded_run_of_a_model_file_it_cannot_read_stops_every_process_with_one_line(tmp_path):
    """Process 0 is refused in its turn (a file that is not a model); process 1 never reads it, and says the
    same line: no traceback from either (accelerate's launcher adds its own account of the failed processes),
nothing left in the output folder."""
    bad = tmp_path / "flux.safetensors"
    bad.write_bytes(b"not a safetensors file")
    script, values = MODELS["tiny-flux"]
    done = _launch(script, _config(tmp_path, "bad", {**values, "pretrained_model_name_or_path": str(bad)},
                                   fsdp="full_shard"))
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.startswith("flux_train_network: error:")]
    assert len(lines) == 2 and lines[0] == lines[1] and str(bad) in lines[0], done.stderr[-3000:]
    assert not re.search(r"\[rank\d\]: Traceback", done.stderr) and not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_averaging_the_gradients_of_several_processes_adds_nothing_at_a_step_whose_activations_dominate(tmp_path):
    """The planner counts no all-reduce copy for our engine where the activations are larger than the LoRA's
    gradients (``search.all_reduce_bytes``): the flat copy is made after the backward. On the emulated card,
    tiny-flux at 256 px, what a second process adds to the peak does not grow with the rank (measured: 0.06 MiB at
    rank 4 and at rank 64, whose gradients are 0.72 MiB)."""
    import json

    script, values = MODELS["tiny-flux"]
    env = {**ENV, "SD_COMPAT_EMULATED_CARD_MIB": "100000"}
    added = {}
    for rank in (4, 64):
        peaks = []
        for processes in (1, 2):
            name = f"r{rank}p{processes}"
            config = _config(tmp_path, name, values, resolution="256,256", network_dim=rank, network_alpha=rank)
            events = ["--autotune_events_dir", str(tmp_path / f"{name}-events")]
            command = _command(script, config, *events) if processes == 2 else [
                sys.executable, "-m", f"sd_scripts_compat.{script}", "--config_file", str(config), *events]
            done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
            assert done.returncode == 0, done.stderr[-3000:]
            report = json.loads((tmp_path / f"{name}-events" / "done.json").read_text(encoding="utf-8"))
            peaks.append(report["memory"]["emulated_card_peak_mib"])
        added[rank] = peaks[1] - peaks[0]
    assert added[64] == pytest.approx(added[4], abs=0.01)
