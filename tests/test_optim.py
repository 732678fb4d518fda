"""Optimizers and schedulers by kohya's names (sd_scripts_compat/training/optim.py), built for real on CPU tensors."""

from __future__ import annotations

import pytest
import torch

from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.training.optim import make_lr_scheduler, make_optimizer


def lora_like_groups(seed: int = 0, lrs: tuple[float, float] = (1e-4, 5e-5)) -> list[dict]:
    """Two parameter groups (text encoder, UNet) shaped like LoRA down/up weights, with gradients."""
    generator = torch.Generator().manual_seed(seed)
    groups = []
    for lr in lrs:
        params = [torch.nn.Parameter(torch.randn(4, 32, generator=generator)),
                  torch.nn.Parameter(torch.randn(32, 4, generator=generator))]
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        groups.append({"params": params, "lr": lr})
    return groups


def test_adamw_is_fused_on_cpu_and_takes_the_same_step_as_the_per_tensor_loop():
    fused_groups, loop_groups = lora_like_groups(), lora_like_groups()
    fused, name = make_optimizer("AdamW", fused_groups, 1e-4, {"weight_decay": 0.01})
    loop, _ = make_optimizer("adamw", loop_groups, 1e-4, {"weight_decay": 0.01, "foreach": False})
    assert fused.defaults["fused"] is True
    assert not loop.defaults.get("fused")
    assert name == "torch.optim.adamw.AdamW(weight_decay=0.01)"  # ss_optimizer records what the user asked for
    for _ in range(3):
        fused.step()
        loop.step()
    for fused_group, loop_group in zip(fused_groups, loop_groups, strict=True):
        for a, b in zip(fused_group["params"], loop_group["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_users_fused_or_foreach_choice_is_kept():
    optimizer, name = make_optimizer("AdamW", lora_like_groups(), 1e-4, {"fused": False})
    assert optimizer.defaults["fused"] is False and name == "torch.optim.adamw.AdamW(fused=False)"
    optimizer, _ = make_optimizer("AdamW", lora_like_groups(), 1e-4, {"foreach": True})
    assert optimizer.defaults["foreach"] is True and not optimizer.defaults.get("fused")
    assert make_optimizer("AdamW", lora_like_groups(), 1e-4, {})[1] == "torch.optim.adamw.AdamW"  # no "()"


@pytest.mark.parametrize(("kohya_name", "class_name"), [
    ("AdamW", "AdamW"), ("Lion", "Lion32bit"), ("Prodigy", "Prodigy"), ("Adafactor", "Adafactor"),
])
def test_kohya_names_build_their_optimizer_and_step(kohya_name, class_name):
    lr = 1.0 if kohya_name == "Prodigy" else 1e-3  # Prodigy wants lr 1 and one lr for every group
    groups = lora_like_groups(lrs=(lr, lr))
    before = [p.detach().clone() for group in groups for p in group["params"]]
    optimizer, _ = make_optimizer(kohya_name, groups, lr, {})
    assert type(optimizer).__name__ == class_name
    optimizer.step()
    after = [p for group in groups for p in group["params"]]
    assert all(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_unknown_optimizer_and_bad_arguments_are_one_line_user_errors():
    with pytest.raises(UserError, match="optimizer_type 'SGDish' is not supported"):
        make_optimizer("SGDish", lora_like_groups(), 1e-4, {})
    with pytest.raises(UserError, match="optimizer_args for AdamW"):
        make_optimizer("AdamW", lora_like_groups(), 1e-4, {"betas_typo": 1})


def test_constant_with_warmup_rises_then_holds_and_constant_refuses_warmup():
    optimizer, _ = make_optimizer("AdamW", lora_like_groups(), 1e-4, {})
    scheduler = make_lr_scheduler("constant_with_warmup", optimizer, num_training_steps=10, num_warmup_steps=4)
    lrs = []
    for _ in range(6):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert lrs[0] == 0.0 and lrs[2] == pytest.approx(0.5e-4) and lrs[4] == lrs[5] == pytest.approx(1e-4)
    with pytest.raises(UserError, match="constant_with_warmup"):
        make_lr_scheduler("constant", optimizer, num_training_steps=10, num_warmup_steps=4)
