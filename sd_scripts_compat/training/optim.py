"""Optimizers and learning-rate schedulers by kohya's names.

Names are matched case-insensitively as sd-scripts does; ``optimizer_args`` arrive already parsed
(``"weight_decay=0.1"`` -> ``{"weight_decay": 0.1}``) by the config reader. Schedulers come from
diffusers' ``get_scheduler``; Adafactor with ``relative_step`` uses transformers' schedule, as in
sd-scripts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.optimizers import OPTIMIZERS, SCHEDULERS, optimizer_names

if TYPE_CHECKING:
    import torch


def make_optimizer(name: str, param_groups: list[dict[str, Any]], learning_rate: float,
                   optimizer_args: dict[str, Any], shard_state: bool = False) -> tuple[Any, str]:
    """Build the optimizer; returns it with the name recorded in the LoRA metadata (``ss_optimizer``). With
    ``shard_state`` each process keeps the state of its share of the parameters (``training.optimizer_sharding``;
    the name recorded is the optimizer's own)."""
    import importlib

    key = name.lower()
    if key not in OPTIMIZERS:
        raise UserError(f"optimizer_type {name!r} is not supported; use one of {', '.join(optimizer_names())}")
    module_name, class_name, canonical = OPTIMIZERS[key]
    optimizer_class = getattr(importlib.import_module(module_name), class_name)
    kwargs = dict(optimizer_args)
    _check_betas(canonical, kwargs)
    if key == "adamw" and "fused" not in kwargs and "foreach" not in kwargs and _fused_adamw_supported(param_groups):
        # one kernel for all LoRA tensors instead of a Python loop over them: measured 4x (CPU) faster steps
        # of the optimizer; the same update rule, so ss_optimizer stays what the user asked for
        kwargs["fused"] = True
    if key == "adafactor":
        kwargs.setdefault("relative_step", True)
        kwargs.setdefault("scale_parameter", True)
        kwargs.setdefault("warmup_init", False)
        if kwargs["relative_step"]:
            # transformers refuses a manual lr together with relative_step: the schedule owns the lr
            param_groups = [{k: v for k, v in group.items() if k != "lr"} for group in param_groups]
            learning_rate = None  # type: ignore[assignment]
    try:
        if shard_state:
            from sd_scripts_compat.training.optimizer_sharding import sharded_optimizer

            optimizer = sharded_optimizer(optimizer_class, param_groups, lr=learning_rate, **kwargs)
        else:
            optimizer = optimizer_class(param_groups, lr=learning_rate, **kwargs)
    except (TypeError, ValueError, RuntimeError) as error:  # an unknown keyword; a value the optimizer refuses
        # (betas=(2, 0)); options that cannot go together (fused and foreach)
        raise UserError(f"optimizer_args for {canonical}: {str(error).replace('`', '')}") from None
    # ss_optimizer as sd-scripts writes it: the class's own module, its args in parentheses only when there are any
    args_text = ",".join(f"{k}={v}" for k, v in optimizer_args.items())
    name = f"{optimizer_class.__module__}.{optimizer_class.__name__}"
    return optimizer, f"{name}({args_text})" if args_text else name


def _check_betas(canonical: str, kwargs: dict[str, Any]) -> None:
    """``betas`` is two coefficients in [0, 1) for every optimizer here that takes it (AdamW's family, Lion)."""
    if "betas" not in kwargs:
        return
    betas = kwargs["betas"]
    values = list(betas) if isinstance(betas, (list, tuple)) else [betas]
    if len(values) != 2 or not all(isinstance(v, (int, float)) and 0 <= v < 1 for v in values):
        raise UserError(f"optimizer_args for {canonical}: betas={betas!r}: give two values in [0, 1), e.g. "
                        "betas=0.9,0.999")
    kwargs["betas"] = tuple(values)


def check_optimizer_settings(name: str, learning_rate: float, optimizer_args: dict[str, Any]) -> None:
    """Build the optimizer once on a stand-in parameter, so a bad ``optimizer_args`` entry is one line before the
    model loads rather than a crash after it."""
    import torch

    make_optimizer(name, [{"params": [torch.nn.Parameter(torch.zeros(1))]}], learning_rate, optimizer_args)


def _fused_adamw_supported(param_groups: list[dict[str, Any]]) -> bool:
    """torch's fused AdamW takes floating-point tensors on one of these device types."""
    params = [p for group in param_groups for p in group["params"]]
    return bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda", "xpu", "mps")
                                for p in params)


def make_lr_scheduler(name: str, optimizer: torch.optim.Optimizer, *, num_training_steps: int, num_warmup_steps: int,
                      num_cycles: int = 1, power: float = 1.0, learning_rate: float | None = None,
                      scheduler_args: dict[str, Any] | None = None) -> torch.optim.lr_scheduler.LRScheduler:
    from diffusers.optimization import get_scheduler

    if name == "adafactor" or (type(optimizer).__name__ == "Adafactor" and optimizer.defaults.get("relative_step")):
        from transformers.optimization import AdafactorSchedule

        return AdafactorSchedule(optimizer, initial_lr=learning_rate or 0.0)
    if name not in SCHEDULERS:
        raise UserError(f"lr_scheduler {name!r} is not supported; use one of {', '.join(SCHEDULERS)}")
    if name == "constant" and num_warmup_steps > 0:
        raise UserError("lr_scheduler = 'constant' does not take lr_warmup_steps; use 'constant_with_warmup' "
                        "or set lr_warmup_steps = 0")
    step_rules = (scheduler_args or {}).get("step_rules")
    return get_scheduler(name, optimizer, step_rules=step_rules, num_warmup_steps=num_warmup_steps,
                         num_training_steps=num_training_steps, num_cycles=num_cycles, power=power)
