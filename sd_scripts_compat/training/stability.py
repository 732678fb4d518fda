"""Catching a run that has gone unstable, without a per-step host sync.

A loss that turns NaN or explodes (fp16 overflow, a learning rate too high for the batch, a bad
image) otherwise trains on for hours and writes LoRA files full of NaN. The guard works in two places:

On the device, every optimizer step: each micro-batch's loss is added into this step's slot of a
device buffer, and the total norm of the LoRA gradients (``torch._foreach_norm``, or the norm that
gradient clipping already computed) goes into the slot next to it. With torch's fused Adam/AdamW the
optimizer's ``found_inf`` is set from ``~isfinite(loss + grad norm)``, so the fused kernel itself skips a
bad update (weights, moments and its step count untouched). Other optimizers apply it; the watchdog's
rollback to the last good state undoes it. Nothing here waits for the device.

On the host, when the buffer is read: at the progress refresh the loop already syncs for (about every
2 s), and before every save (one sync per save, so that a save is only ever made from finite weights:
the LoRA weights' norm is read with the buffer then). The per-step values are judged by these rules:

- non-finite: a NaN/inf loss or gradient norm at any step trips at once. Where a loss scaler owns
  the non-finite gradients (accelerate's GradScaler for fp16 mixed precision, our own scale for
  ``full_fp16``), those steps are skipped by the scaler and are routine, so gradients are not judged and
  a non-finite *loss* trips only after :data:`SCALED_NONFINITE_STREAK` steps in a row (the scale does
  not touch the forward pass: a loss that stays non-finite is an overflow no scale can fix).
- divergence: once :data:`BASELINE_STEPS` finite step losses are seen, their median is the run's
  baseline (kept in the state, so a resumed run keeps its early level). The rule trips when the median
  of the last :data:`WINDOW_STEPS` finite step losses exceeds :data:`DIVERGENCE_FACTOR` x the baseline.
  Why a median of per-step values: the diffusion loss of one step swings with its random timestep by
  an order of magnitude, so single steps or a mean would trip on noise; a window median is above the
  threshold only when more than half of the window is (17 of 32 steps), i.e. a sustained rise: a
  clean rise trips at its 17th step. Simulated on a heavy-tailed per-step loss (log-normal, sigma 1
  in log): no false trip in 300 healthy runs of 2,000 steps, and a rise to 20x trips 9 to 22 steps
  after it began (measured choosing the constants; tests/test_stability.py re-checks 40 runs). It
  judges only after the baseline (32 steps) and a full window (32 more): an explosion earlier than
  step 64 almost always shows as NaN/inf, which trips at once.
- non-finite weights (checked only before a save): trips, and the save is not made.

A trip raises :class:`Diverged` with the report the engine writes as ``diverged.json``.
``SD_COMPAT_NO_DIVERGENCE_CHECK=1`` turns the checks off (the loss is still summed for the progress
bar): only ``bench/engine.py`` sets it, to time the step with and without them.
"""

from __future__ import annotations

import math
import os
import statistics
from collections import deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

NO_CHECK_ENV = "SD_COMPAT_NO_DIVERGENCE_CHECK"
BUFFER_STEPS = 1024  # device slots; a full buffer is read early (one sync per 1024 steps at worst)
BASELINE_STEPS = 32
WINDOW_STEPS = 32
DIVERGENCE_FACTOR = 4.0
SCALED_NONFINITE_STREAK = 3
HISTORY_STEPS = 64  # the last steps' values in the diverged event
BASELINE_KEY = "loss_baseline"  # in TrainCounters.extra, so it travels with the state


class Diverged(Exception):  # noqa: N818 - an ending of the run, like KeyboardInterrupt, not an error
    """The run is unstable; ``report`` is the body of the ``diverged`` event (without settings)."""

    def __init__(self, report: dict[str, Any]) -> None:
        super().__init__(report["reason"])
        self.report = report


def _finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


class DivergenceRule:
    """The host side: judges per-step values in step order (see the module docstring for the rules)."""

    def __init__(self, *, scaled: bool, baseline: float | None) -> None:
        self.scaled = scaled
        self.baseline = baseline
        self.samples: list[float] = []  # finite losses until the baseline is known
        self.window: deque[float] = deque(maxlen=WINDOW_STEPS)
        self.history: deque[tuple[int, float, float | None]] = deque(maxlen=HISTORY_STEPS)
        self.streak = 0  # consecutive non-finite losses (scaled runs)
        self.first_bad: int | None = None

    def judge(self, step: int, loss: float, grad_norm: float | None) -> tuple[str, str] | None:
        """(kind, reason) when ``step`` trips a rule, else None. ``step``: 0-based index of the step."""
        self.history.append((step, loss, grad_norm))
        if not math.isfinite(loss):
            self.first_bad = step if self.first_bad is None else self.first_bad
            self.streak += 1
            if not self.scaled or self.streak >= SCALED_NONFINITE_STREAK:
                streak = f" ({self.streak} steps in a row, each skipped by the loss scaler)" if self.scaled else ""
                return "nonfinite_loss", f"the loss is {loss} at step {step}{streak}"
            return None
        self.streak = 0
        if grad_norm is not None and not math.isfinite(grad_norm):
            self.first_bad = step
            return "nonfinite_grad", f"the LoRA gradients are not finite at step {step} (norm {grad_norm})"
        if self.baseline is None:
            self.samples.append(loss)
            if len(self.samples) >= BASELINE_STEPS:
                self.baseline = statistics.median(self.samples)
            return None
        self.window.append(loss)
        if len(self.window) == WINDOW_STEPS:
            median = statistics.median(self.window)
            if median > DIVERGENCE_FACTOR * self.baseline:
                self.first_bad = step - WINDOW_STEPS // 2  # where the rise that tripped the median began
                return "divergence", (f"the loss diverged: median {median:.4g} of steps {step - WINDOW_STEPS + 1}-"
                                      f"{step} is over {DIVERGENCE_FACTOR:g} x the run's early level "
                                      f"{self.baseline:.4g}")
        return None

    def report(self, kind: str, reason: str) -> dict[str, Any]:
        return {"kind": kind, "reason": reason, "step": self.first_bad, "baseline_loss": self.baseline,
                "loss_history": [[s, _finite_or_none(loss), _finite_or_none(norm)] for s, loss, norm in self.history]}


def total_norm(tensors: list[Any]) -> torch.Tensor:
    """The 2-norm over all tensors, as a float32 device scalar (no sync); NaN/inf when any value is."""
    import torch

    if not tensors:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)))


def fused_torch_adam(optimizer: torch.optim.Optimizer) -> bool:
    """torch's Adam/AdamW with ``fused=True``: the only optimizers whose kernel reads ``found_inf``
    (the others refuse the attribute)."""
    import torch

    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and bool(optimizer.param_groups) and all(
        group.get("fused") for group in optimizer.param_groups)


class StabilityGuard:
    """The device buffer, the per-step device checks and the host reads of one training session.

    ``params``: the trainable LoRA tensors; ``optimizer``: the torch optimizer (unwrapped);
    ``scaled``: a loss scaler owns non-finite gradients; ``extra``: the counters' ``extra`` dict (the
    baseline is read from and written into it).
    """

    def __init__(self, device: str | torch.device, params: list[Any], optimizer: torch.optim.Optimizer, *, scaled: bool,
                 extra: dict[str, Any], enabled: bool | None = None) -> None:
        import torch

        self.enabled = os.environ.get(NO_CHECK_ENV, "") not in ("1", "true") if enabled is None else enabled
        self.params, self.optimizer, self.scaled, self.extra = params, optimizer, scaled, extra
        self.fused = not scaled and fused_torch_adam(optimizer)
        self.buffer = torch.zeros((2, BUFFER_STEPS), device=device)  # row 0: loss sums, row 1: grad norms
        self.slot = 0
        self.slot_steps: list[tuple[int, int]] = []  # (step index, micro-batches) of each filled slot
        self.micro = 0  # micro-batches added to the current slot
        self.report_sum, self.report_count = 0.0, 0  # host: the losses read since the last progress refresh
        self.rule = DivergenceRule(scaled=scaled, baseline=extra.get(BASELINE_KEY))
        self.tripped: dict[str, Any] | None = None

    def add_loss(self, loss: torch.Tensor) -> None:
        """One micro-batch's loss, summed into this step's slot on the device."""
        self.buffer[0, self.slot].add_(loss.detach())
        self.micro += 1

    def before_optimizer_step(self, grad_norm: Any | None = None) -> None:
        """Record this step's gradient norm; with fused Adam, let a bad step skip itself on the device."""
        if not self.enabled or self.scaled:
            return
        import torch

        if grad_norm is None:
            grad_norm = total_norm([p.grad for p in self.params if p.grad is not None])
        self.buffer[1, self.slot].copy_(grad_norm)
        if self.fused:
            self.optimizer.found_inf = (  # type: ignore[attr-defined]  # fused Adam reads it if present
                ~torch.isfinite(self.buffer[0, self.slot] + grad_norm)).float()

    def after_optimizer_step(self, step: int) -> None:
        """The step with 0-based index ``step`` is done; a full buffer is read now."""
        self.slot_steps.append((step, max(self.micro, 1)))
        self.slot += 1
        self.micro = 0
        if self.slot == BUFFER_STEPS:
            self.read()

    def read(self, *, check_weights: bool = False) -> None:
        """Read the buffer (one host sync) and judge its steps; raises :class:`Diverged` on a trip."""
        if self.tripped is not None:
            raise Diverged(self.tripped)
        check_weights = check_weights and self.enabled
        if self.slot == 0 and not check_weights:
            return
        import torch

        count = self.slot
        parts = [self.buffer[:, :count].reshape(-1)]
        if check_weights:
            parts.append(total_norm([p.detach() for p in self.params]).reshape(1).to(self.buffer.device))
        values = torch.cat(parts).tolist()
        self.buffer[:, :count].zero_()
        steps, self.slot_steps, self.slot = self.slot_steps, [], 0
        done = steps[-1][0] + 1 if steps else None  # steps done when the host sees them
        for i, (step, micro) in enumerate(steps):
            self.report_sum += values[i]
            self.report_count += micro
            if not self.enabled:
                continue
            trip = self.rule.judge(step, values[i] / micro, None if self.scaled else values[count + i])
            if self.rule.baseline is not None and BASELINE_KEY not in self.extra:
                self.extra[BASELINE_KEY] = self.rule.baseline
            if trip is not None:
                self._trip(*trip, tripped_at=step, detected_at=done)
        if check_weights and not math.isfinite(values[-1]):
            self._trip("nonfinite_weights", f"the LoRA weights are not finite (norm {values[-1]}): not saved",
                       tripped_at=done, detected_at=done)

    def _trip(self, kind: str, reason: str, *, tripped_at: int | None, detected_at: int | None) -> None:
        self.tripped = {**self.rule.report(kind, reason), "tripped_at_step": tripped_at,
                        "detected_at_step": detected_at}
        raise Diverged(self.tripped)

    def report_loss(self) -> float:
        """Mean loss per micro-batch since the last call (reads the buffer first), as the progress bar shows."""
        self.read()
        mean = self.report_sum / max(self.report_count, 1)
        self.report_sum, self.report_count = 0.0, 0
        return mean

    def before_save(self) -> None:
        """A save is made only from finite weights: read everything (one sync), raise on any trip."""
        self.read(check_weights=True)
