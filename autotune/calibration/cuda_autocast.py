"""CUDA autocast's op lists applied to CPU tensors, so a fake-tensor trace on this CPU keeps what a GPU keeps.

Our memory traces run on fake CPU tensors (fake CUDA tensors abort in autograd without a CUDA build), so they ran
under CPU autocast, whose lists differ from CUDA's: CUDA runs exp, pow, rsqrt, layer_norm, group_norm, rms_norm,
softmax, sum and the upsamplers in fp32 (``aten/src/ATen/autocast_mode.h``: ``AT_FORALL_FP32``,
``AT_FORALL_FP32_SET_OPT_DTYPE``), CPU autocast leaves them in bf16, so every activation they save for backward
was half its GPU size. :func:`cuda_op_lists` registers, for the span of a trace, a Python kernel at the
``AutocastCPU`` dispatch key of every operator whose CUDA policy differs from CPU's: the CUDA policy (the casts
``autocast_mode.h``'s ``WrapFunction_`` does, below autograd's recording as there), and a plain redispatch (CUDA's
fallthrough) for operators only CPU autocast lists. Operators both lists cast the same way keep torch's kernels
(and their weight-cast cache). The table is checked against the installed torch's own ``AutocastCUDA``
registrations and, op by op, against CUDA autocast itself on fake CUDA tensors (``tests/test_cuda_autocast.py``).

Hand-written because torch has no switch for it: ``torch.library.register_autocast`` only sets a cast for custom
operators, and CUDA autocast cannot run on CPU tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

LOWER = "lower_precision_fp"  # inputs cast to the autocast dtype
FP32 = "fp32"  # inputs cast to fp32
FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"  # an unset ``dtype`` argument becomes fp32 (softmax, sum)
FP32_APPEND_DTYPE = "fp32_append_dtype"  # redispatched to the overload with a dtype, fp32 (norm)
PROMOTE = "promote"  # the widest floating dtype among the inputs
BANNED = "banned"  # CUDA autocast raises (binary_cross_entropy)

_LOWER = """_convolution _convolution.deprecated conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d.input
conv_transpose3d.input convolution prelu addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm baddbmm bmm
chain_matmul linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell
rnn_relu_cell _scaled_dot_product_flash_attention scaled_dot_product_attention cudnn_convolution
cudnn_convolution_transpose"""
_FP32 = """acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow.Tensor_Scalar
pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm group_norm rms_norm frobenius_norm.dim nuclear_norm
nuclear_norm.dim cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss
kl_div l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss
triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp
upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d _upsample_nearest_exact2d upsample_nearest3d
_upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d _upsample_bilinear2d_aa upsample_trilinear3d
upsample_bicubic2d _upsample_bicubic2d_aa"""
_FP32_SET_OPT_DTYPE = """prod prod.dim_int softmax.int log_softmax.int cumprod cumsum linalg_vector_norm
linalg_matrix_norm linalg_matrix_norm.str_ord sum sum.dim_IntList"""
_PROMOTE = "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add"

# CUDA autocast's policy per operator ("name.overload"), as registered for AutocastCUDA in autocast_mode.cpp.
CUDA_POLICIES: dict[str, str] = {
    **dict.fromkeys(_LOWER.split(), LOWER), **dict.fromkeys(_FP32.split(), FP32),
    **dict.fromkeys(_FP32_SET_OPT_DTYPE.split(), FP32_SET_OPT_DTYPE), **dict.fromkeys(_PROMOTE.split(), PROMOTE),
    "norm.Scalar": FP32_APPEND_DTYPE, "norm.ScalarOpt_dim": FP32_APPEND_DTYPE, "binary_cross_entropy": BANNED,
}
# Operators CPU autocast lists under the same policy as CUDA: torch's own AutocastCPU kernels stay.
SAME_ON_CPU = frozenset("""_convolution.deprecated addbmm addmm baddbmm bmm conv1d conv2d conv3d conv_tbc
conv_transpose1d conv_transpose2d.input conv_transpose3d.input linalg_vecdot linear matmul mm prelu
scaled_dot_product_attention binary_cross_entropy_with_logits cdist cosine_embedding_loss hinge_embedding_loss
huber_loss kl_div l1_loss margin_ranking_loss mse_loss multi_margin_loss multilabel_margin_loss nll_loss nll_loss2d
poisson_nll_loss smooth_l1_loss soft_margin_loss triplet_margin_loss""".split())
_APPEND_DTYPE_TARGET = {"norm.Scalar": "ScalarOpt_dtype", "norm.ScalarOpt_dim": "ScalarOpt_dim_dtype"}


def autocast_operators(dispatch_key: str) -> set[str]:
    """The aten operators ("name.overload") the installed torch registers a kernel for at ``dispatch_key``
    (``AutocastCUDA``, ``AutocastCPU``): the dispatcher's own record of an autocast op list."""
    import torch

    return {name.removeprefix("aten::") for name in torch._C._dispatch_get_all_op_names()
            if name.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(name, dispatch_key)}


def _overload(name: str) -> Any:
    import torch

    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _lower() -> Any:
    """The autocast region's lower-precision dtype (CPU autocast's, as set by the caller's ``torch.autocast``)."""
    import torch

    return torch.get_autocast_dtype("cpu")


def _eligible(value: Any) -> bool:
    """What CUDA's ``cached_cast`` casts, of CPU tensors: floating point but not fp64. (torch also caches the
    lower-precision copy of an fp32 leaf that requires grad for the autocast region; the operators these kernels
    take over never see LoRA weights, which go through ``linear``, whose own kernel stays.)"""
    import torch

    return (isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.is_floating_point()
            and value.dtype != torch.float64)


def _cast(value: Any, dtype: Any) -> Any:
    if isinstance(value, list | tuple):
        return type(value)(_cast(v, dtype) for v in value)
    return value.to(dtype) if _eligible(value) and value.dtype != dtype else value


def _widest(args: tuple[Any, ...]) -> Any:
    import torch

    flat = [v for a in args for v in (a if isinstance(a, list | tuple) else (a,))]
    return torch.float32 if any(_eligible(v) and v.dtype == torch.float32 for v in flat) else _lower()


def _first_eligible(args: tuple[Any, ...]) -> bool:
    return bool(args) and _eligible(args[0])


def _kernel(name: str, policy: str | None) -> Any:
    """The Python AutocastCPU kernel that does what CUDA's ``WrapFunction_<policy>`` does."""
    import torch

    op = _overload(name)
    no_autocast = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        if policy is None:  # not in CUDA's lists: fall through to the kernels below autocast
            return op.redispatch(keyset.remove(torch._C.DispatchKey.AutocastCPU), *args, **kwargs)
        with torch._C._ExcludeDispatchKeyGuard(no_autocast):
            return _apply(name, op, policy, args, kwargs)

    return kernel


def _apply(name: str, op: Any, policy: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    import torch

    if policy in (LOWER, FP32, PROMOTE):
        dtype = (_lower() if policy == LOWER else torch.float32 if policy == FP32
                 else _widest((*args, *kwargs.values())))
        return op(*_cast(args, dtype), **{k: _cast(v, dtype) for k, v in kwargs.items()})
    if policy == FP32_SET_OPT_DTYPE:
        if _first_eligible(args) and kwargs.get("dtype") is None:
            return _with_dtype(op, args, kwargs, torch.float32)
        return op(*args, **kwargs)
    if policy == FP32_APPEND_DTYPE:
        dtype = torch.float32 if _first_eligible(args) else args[0].dtype
        base, _, _ = name.partition(".")
        return getattr(getattr(torch.ops.aten, base), _APPEND_DTYPE_TARGET[name])(*args, dtype=dtype, **kwargs)
    raise RuntimeError(f"CUDA autocast does not allow aten::{name} (torch raises for it on a GPU)")


def _with_dtype(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dtype: Any) -> Any:
    """Call ``op`` with its ``dtype`` argument set, positional where the caller gave it by position."""
    names = [a.name for a in op._schema.arguments]
    index = names.index("dtype")
    if len(args) > index:
        return op(*args[:index], dtype, *args[index + 1:], **kwargs)
    return op(*args, **{**kwargs, "dtype": dtype})


AUTOCAST_RULES = ("cuda", "cpu")


def autocast_rules(rules: str) -> contextlib.AbstractContextManager[None]:
    """Whose op lists CPU autocast follows inside the ``with``: ``"cuda"`` (a trace for a GPU plan) or ``"cpu"``
    (torch's own, for a CPU plan). Where autocast is on stays the caller's (``torch.autocast("cpu", ...)``)."""
    if rules not in AUTOCAST_RULES:
        raise ValueError(f"autocast rules must be one of {', '.join(AUTOCAST_RULES)}, not {rules!r}")
    return cuda_op_lists() if rules == "cuda" else contextlib.nullcontext()


@contextlib.contextmanager
def cuda_op_lists() -> Iterator[None]:
    """CPU autocast casts as CUDA autocast does for the span of the ``with`` (the kernels are the process's until
    the block ends; torch's own are back after it). One tracer at a time: not for threads."""
    import warnings

    import torch

    library = torch.library.Library("aten", "IMPL")
    on_cpu = autocast_operators("AutocastCPU")
    registered: dict[str, str | None] = {name: policy for name, policy in CUDA_POLICIES.items()
                                         if name not in SAME_ON_CPU}
    registered.update({name: None for name in on_cpu if name not in CUDA_POLICIES})
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel": that is the point
            for name, policy in registered.items():
                library.impl(name, _kernel(name, policy), "AutocastCPU", with_keyset=True)
        yield
    finally:
        library._destroy()
