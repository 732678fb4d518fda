"""CUDA autocast's op lists on CPU tensors (``autotune.calibration.cuda_autocast``), checked against CUDA autocast.

No GPU here, but torch's own ``AutocastCUDA`` kernels are in every build and run on fake CUDA tensors (no
autograd: the autograd engine needs a CUDA build). So every distinct torch call a family's denoiser makes in a
traced step is replayed twice: on fake CUDA tensors under torch's CUDA autocast, and on fake CPU tensors under CPU
autocast with our lists; the output dtypes must be the same call for call. A call that cannot run on a fake CUDA
tensor without CUDA (Python indexing takes a CUDA device guard) or on any fake tensor (``.tolist()``) is counted
and left out: none of them is an autocast-listed op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

TINY_DENOISERS = ("tiny-flux", "tiny-sd3", "tiny-chroma")
FULL_SIZE_DENOISERS = ("flux-dev", "sd3.5-large", "chroma", "qwen-image", "flux2-klein-4b", "wan2.1-t2v-1.3b",
                       "z-image", "lumina2", "hunyuan-image-2.1", "anima")
UNETS = ("tiny-sd15", "tiny-sdxl")
TWINNED = ("flux-dev", "sd3.5-large", "chroma")  # the classes of tiny-flux, tiny-sd3, tiny-chroma at full size


def _is_tensor_meta(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 3 and value[0] == "tensor"


def _recorded_calls(run_forward: Any) -> list[tuple[Any, Any]]:
    """Each torch call made while CPU autocast is on, as (function, arguments with tensors as shape and dtype)."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_map

    calls: list[tuple[Any, Any]] = []

    class Calls(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            kwargs = kwargs or {}
            if torch.is_autocast_enabled("cpu"):
                calls.append((func, tree_map(lambda t: ("tensor", tuple(t.shape), t.dtype)
                                             if isinstance(t, torch.Tensor) else t, (args, kwargs))))
            return func(*args, **kwargs)

    with Calls():
        run_forward()
    return calls


@contextlib.contextmanager
def _torch_cuda_autocast() -> Iterator[None]:
    """torch's CUDA autocast switched on directly (``torch.autocast("cuda")`` turns itself off without CUDA)."""
    import torch

    torch.set_autocast_dtype("cuda", torch.bfloat16)
    torch.set_autocast_enabled("cuda", True)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", False)


def _output_dtypes(func: Any, meta: Any, device: str, ours: bool) -> tuple[str, ...]:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_leaves, tree_map

    from autotune.calibration.cuda_autocast import autocast_rules

    with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad(), contextlib.ExitStack() as stack:
        args, kwargs = tree_map(lambda m: torch.empty(m[1], dtype=m[2], device=device) if _is_tensor_meta(m) else m,
                                meta, is_leaf=_is_tensor_meta)
        if device == "cuda":
            stack.enter_context(_torch_cuda_autocast())
        else:
            stack.enter_context(autocast_rules("cuda" if ours else "cpu"))
            stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
        out = func(*args, **kwargs)
    return tuple(str(t.dtype) for t in tree_leaves(out) if isinstance(t, torch.Tensor))


def _compare(calls: list[tuple[Any, Any]], ours: bool = True) -> tuple[int, set[str], list[str]]:
    """(calls compared, the names of the calls left out, differences) over the distinct calls."""
    distinct = {(getattr(f, "__name__", repr(f)), repr(m)): (f, m) for f, m in calls}
    compared, left_out, differences = 0, set(), []
    for (name, _), (func, meta) in distinct.items():
        try:
            on_gpu = _output_dtypes(func, meta, "cuda", ours)
        except RuntimeError as error:  # a CUDA device guard (indexing) or a data-dependent value
            if "not linked with support for cuda" in str(error) or "not supported for tensor subclasses" in str(error):
                left_out.add(name)
                continue
            raise
        on_cpu = _output_dtypes(func, meta, "cpu", ours)
        compared += 1
        if on_gpu != on_cpu:
            differences.append(f"{name}: CUDA {on_gpu}, ours {on_cpu}")
    return compared, left_out, differences


@contextlib.contextmanager
def _no_backward() -> Iterator[None]:
    """The traced step's forward only: its ``loss.backward()`` does nothing here (the forward is what autocast
    casts; the replay runs without autograd)."""
    import torch

    backward = torch.Tensor.backward
    torch.Tensor.backward = lambda self, *args, **kwargs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.backward = backward  # type: ignore[method-assign]


def _denoiser_calls(family: str) -> list[tuple[Any, Any]]:
    """The torch calls of one traced step's forward of ``family``'s transformer (the tracer's own inputs)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autotune.calibration import dit_memtrace
    from autotune.calibration.memtrace import LiveBytesCounter, fakeify

    spec = dit_memtrace.trace_family(family)
    model = dit_memtrace.build_bundle(spec).unet
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakeify([model], fake_mode)
    resolution = 128 if spec.tiny else spec.resolution // 2
    forward = dit_memtrace.FORWARDS[spec.denoiser_class]
    with fake_mode, torch.no_grad(), _no_backward():
        return _recorded_calls(lambda: forward(model, LiveBytesCounter(), spec, 1, resolution,
                                               spec.denoiser_text_tokens))


def _unet_calls(family: str) -> list[tuple[Any, Any]]:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autotune.calibration import memtrace
    from sd_scripts_compat.facts.families import get_family

    spec = get_family(family)
    bundle, network, dtype = memtrace._build_for_trace(spec, 4, "bf16", "bf16", False, False, None, None, True)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    memtrace.fakeify([bundle.unet, network], fake_mode)
    step = dict(batch_size=1, resolution=128, module_dtype=dtype, autocast_dtype=torch.bfloat16, cache_latents=True,
                train_text_encoder=False, cache_text_encoder_outputs=True)
    with fake_mode, torch.no_grad(), _no_backward():
        return _recorded_calls(lambda: memtrace._forward_backward(bundle, spec, memtrace.LiveBytesCounter(), **step))


def test_the_table_is_the_installed_torchs_own_cuda_list() -> None:
    from autotune.calibration.cuda_autocast import CUDA_POLICIES, SAME_ON_CPU, autocast_operators

    assert set(CUDA_POLICIES) == autocast_operators("AutocastCUDA")
    assert SAME_ON_CPU <= autocast_operators("AutocastCPU") & set(CUDA_POLICIES)


@pytest.mark.long
# a full-size family whose tiny twin runs the same diffusers classes is slow (for CI's time): the twin's calls stand
@pytest.mark.parametrize("family", TINY_DENOISERS + tuple(
    pytest.param(family, marks=pytest.mark.slow) if family in TWINNED else family for family in FULL_SIZE_DENOISERS))
def test_every_call_of_a_transformer_step_casts_as_cuda_autocast_does(family: str) -> None:
    compared, left_out, differences = _compare(_denoiser_calls(family))
    assert differences == []
    assert compared >= 80 and left_out <= {"__getitem__", "__setitem__", "tolist"}, left_out


@pytest.mark.parametrize("family", UNETS)
def test_every_call_of_a_unet_step_casts_as_cuda_autocast_does(family: str) -> None:
    compared, left_out, differences = _compare(_unet_calls(family))
    assert differences == [] and compared >= 40 and left_out <= {"__getitem__"}, left_out


def test_cpu_autocasts_own_lists_differ_from_cuda_where_the_traces_were_low() -> None:
    """The check has teeth: torch's CPU lists keep the norms and the softmax in bf16, CUDA's in fp32."""
    _, _, differences = _compare(_denoiser_calls("tiny-flux"), ours=False)
    names = {d.split(":")[0] for d in differences}
    assert {"layer_norm", "rms_norm"} <= names, differences


def test_the_lists_hold_only_inside_the_with() -> None:
    import torch
    import torch.nn.functional as F

    from autotune.calibration.cuda_autocast import autocast_rules

    x = torch.randn(2, 8)

    def layer_norm_dtype() -> torch.dtype:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.layer_norm(x @ torch.randn(8, 8), (8,)).dtype

    assert layer_norm_dtype() == torch.bfloat16
    with autocast_rules("cuda"):
        assert layer_norm_dtype() == torch.float32
        assert F.layer_norm(x.bfloat16(), (8,)).dtype == torch.bfloat16  # autocast off: nothing cast
    assert layer_norm_dtype() == torch.bfloat16
    with pytest.raises(ValueError, match="cuda, cpu"):
        autocast_rules("xla")


def test_a_step_traced_under_cuda_rules_keeps_more_and_a_real_run_agrees() -> None:
    """A real CPU step under the same lists (random weights) peaks where the fake trace says; CUDA's fp32 norms and
    softmax keep more activations than CPU autocast's bf16 ones."""
    from autotune.calibration.dit_memtrace import trace_dit_step

    kwargs = dict(resolution=128, rank=4, gradient_checkpointing=False, optimizer="AdamW", text_tokens=16)
    cuda, cpu = (trace_dit_step("tiny-flux", **kwargs, autocast_rules=r) for r in ("cuda", "cpu"))
    real = trace_dit_step("tiny-flux", **kwargs, fake=False, autocast_rules="cuda")
    assert cuda.autocast_rules == "cuda" and cpu.autocast_rules == "cpu"
    assert cuda.activations_peak_bytes > 1.05 * cpu.activations_peak_bytes
    assert real.peak_bytes == pytest.approx(cuda.peak_bytes, rel=0.02)


def test_a_cpu_plan_reads_the_coefficients_traced_under_cpu_rules() -> None:
    from dataclasses import replace

    from autotune.estimate.dit_memory import DitMemoryInputs, dit_family_calibration, predict_dit_memory
    from autotune.estimate.memory_model import MemoryInputs, family_calibration, predict_memory

    for family in ("tiny-flux", "flux-dev"):
        assert dit_family_calibration(family, autocast_rules="cpu")["activations"] == \
            dit_family_calibration(family)["cpu_rules"]["activations"]
        gpu = DitMemoryInputs(family=family, resolution=512, gradient_checkpointing=False)
        on_cpu = replace(gpu, autocast_rules="cpu")
        assert predict_dit_memory(gpu).components["activations"] > predict_dit_memory(on_cpu).components["activations"]
    unet = MemoryInputs(family="sd15", resolution=512, gradient_checkpointing=False, weight_dtype="fp16")
    assert family_calibration("sd2-v", autocast_rules="cpu")["activations"] == \
        family_calibration("sd2")["cpu_rules"]["activations"]
    assert predict_memory(unet).components["activations"] > \
        predict_memory(replace(unet, autocast_rules="cpu")).components["activations"]
    fp32 = replace(unet, weight_dtype="fp32")  # no autocast: no op list applies
    assert predict_memory(fp32).total_bytes == predict_memory(replace(fp32, autocast_rules="cpu")).total_bytes
