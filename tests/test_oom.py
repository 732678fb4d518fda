"""OOM recognition and fault injection (the engine's side of the watchdog contract)."""

from __future__ import annotations

import pytest
import torch

from sd_scripts_compat.facts.contract import is_oom_error
from sd_scripts_compat.training.faults import INJECT_ENV, OomInjector


@pytest.mark.parametrize("message", [
    "CUDA out of memory. Tried to allocate 2.00 GiB",
    "CUDA error: out of memory",
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input.",
    "[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes",
    "HIP out of memory. Tried to allocate 20.00 MiB",
    "MPS backend out of memory (MPS allocated: 1 GB)",
    "could not create a primitive",
])
def test_oom_messages_in_other_clothes_are_recognised(message):
    assert is_oom_error(RuntimeError(message))


def test_real_oom_error_and_unrelated_errors():
    assert is_oom_error(torch.OutOfMemoryError("anything"))
    assert is_oom_error(MemoryError())
    assert not is_oom_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_oom_error(ValueError("out of memory"))  # only runtime errors carry allocator messages


def test_a_real_cpu_allocation_failure_is_recognised():
    with pytest.raises(RuntimeError) as caught:
        torch.empty(2**62, dtype=torch.uint8)
    assert is_oom_error(caught.value)


def test_injected_oom_fires_once_per_step_across_restarts(tmp_path):
    injector = OomInjector.from_env(tmp_path, {INJECT_ENV: "step=3,step=5"})
    injector.check(2, 1, 64, 64)
    with pytest.raises(torch.OutOfMemoryError):
        injector.check(3, 1, 64, 64)
    injector.check(3, 1, 64, 64)  # the marker file makes it fire once
    again = OomInjector.from_env(tmp_path, {INJECT_ENV: "step=3,step=5"})  # a restarted engine
    again.check(3, 1, 64, 64)
    with pytest.raises(torch.OutOfMemoryError):
        again.check(5, 1, 64, 64)


def test_injected_oom_by_pixels_and_bad_rules(tmp_path):
    injector = OomInjector.from_env(tmp_path, {INJECT_ENV: "pixels_gt=8192"})
    injector.check(0, 2, 64, 64)
    with pytest.raises(torch.OutOfMemoryError, match="4x64x64"):
        injector.check(0, 4, 64, 64)
    assert OomInjector.from_env(tmp_path, {}) is None
    with pytest.raises(ValueError, match=INJECT_ENV):
        OomInjector.from_env(tmp_path, {INJECT_ENV: "sometimes"})


def test_one_fault_plan_wraps_the_objective_and_leaves_validation_alone(tmp_path):
    """Both injectors come from one FaultPlan (None when nothing is injected); the wrapped objective raises the
    OOM as a training forward starts and poisons only the loss after a training forward."""
    import torch

    from sd_scripts_compat.training.faults import NAN_ENV, FaultPlan

    assert FaultPlan.from_env(tmp_path, {}) is None

    class Echo:
        def forward(self, denoiser, latents, *rest):
            return latents, ()

        def fixed_forward(self, denoiser, latents, *rest):
            return latents, ()

        def loss(self, prediction, state, weights):
            return prediction.mean(dim=(1, 2, 3))

        noise = "the objective's own attribute"

    plan = FaultPlan.from_env(tmp_path, {INJECT_ENV: "pixels_gt=100", NAN_ENV: "step=2"})
    step = [2]
    wrapped = plan.wrap(Echo(), lambda: step[0], vae_scale=8)
    latents = torch.ones(1, 4, 1, 1)  # 1 x 8 x 8 = 64 px: under the OOM rule
    hidden, generator = torch.zeros(1, 77, 8), torch.Generator()  # the objectives' own arguments (Echo ignores them)
    prediction, state = wrapped.fixed_forward(None, latents, hidden, None, 500, latents)
    assert torch.isfinite(wrapped.loss(prediction, state, None)).all()  # validation at step 2: untouched
    prediction, state = wrapped.forward(None, latents, hidden, None, generator)
    assert torch.isnan(wrapped.loss(prediction, state, None)).all()  # the training forward's loss at step 2
    prediction, state = wrapped.forward(None, latents, hidden, None, generator)
    assert torch.isfinite(wrapped.loss(prediction, state, None)).all()  # once only (its marker file)
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        wrapped.forward(None, torch.ones(2, 4, 1, 1), hidden, None, generator)  # 2 x 8 x 8 = 128 px > 100
    assert wrapped.noise == "the objective's own attribute"


# The CUDA caching allocator's messages (torch >= 2.1, and the wording before it), as users paste them.
NEW_WORDING = ("CUDA out of memory. Tried to allocate 1.22 GiB. GPU 0 has a total capacity of 15.77 GiB of which "
               "959.44 MiB is free. Process 12447 has 14.83 GiB memory in use. Of the allocated memory 14.01 GiB is "
               "allocated by PyTorch, and 472.05 MiB is reserved by PyTorch but unallocated. If reserved but "
               "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
OLD_WORDING = ("CUDA out of memory. Tried to allocate 36.00 MiB (GPU 0; 7.93 GiB total capacity; 130.35 MiB already "
               "allocated; 47.06 MiB free; 188.00 MiB reserved in total by PyTorch)")


def test_where_a_cuda_oom_struck_is_read_from_the_allocators_message_in_both_wordings():
    from sd_scripts_compat.facts.contract import oom_point_mib

    assert oom_point_mib(NEW_WORDING) == pytest.approx(1.22 * 1024 + 14.01 * 1024)
    assert oom_point_mib(OLD_WORDING) == pytest.approx(36.0 + 130.35)
    for other in ("out of memory on the emulated card: 50.03 MiB of tensors live", "DefaultCPUAllocator: can't "
                  "allocate memory: you tried to allocate 1024 bytes", "", None):
        assert oom_point_mib(other) is None


def test_the_step_down_takes_the_oom_point_when_it_is_more_than_the_reserved_peak():
    """A step that ran out while allocating 1.22 GiB on 14.01 GiB allocated needed at least 15.2 GiB, more than the
    14.5 GiB reserved peak the counters kept: the ladder's evidence is the larger."""
    from autotune.recovery.attempt import AttemptResult
    from autotune.recovery.watchdog import measured_mib
    from sd_scripts_compat.facts.contract import Outcome

    def failed(memory: dict) -> AttemptResult:
        return AttemptResult(outcome=Outcome.OOM, returncode=3, message="oom", oom_event={"memory": memory})

    point = (1.22 + 14.01) * 1024
    assert measured_mib(failed({"cuda_max_reserved_mib": 14848.0, "oom_point_mib": point}), "device") == point
    assert measured_mib(failed({"cuda_max_reserved_mib": 16000.0, "oom_point_mib": point}), "device") == 16000.0
    assert measured_mib(failed({"oom_point_mib": point, "peak_rss_mib": 900.0}), "device") == point
    assert measured_mib(failed({"cuda_max_allocated_mib": 14000.0}), "device") == 14000.0
    # the CUDA context the engine measured at start, which neither the reserved peak nor the OOM point counts
    assert measured_mib(failed({"cuda_max_reserved_mib": 16000.0, "cuda_context_mib": 520.0}), "device") == 16520.0
    assert measured_mib(failed({"oom_point_mib": point, "cuda_context_mib": float("nan")}), "device") == point
