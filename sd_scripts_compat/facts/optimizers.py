"""kohya's optimizer and scheduler names: what a config may say (the reader checks them) and which class each
optimizer name means (``training.optim`` builds it)."""

from __future__ import annotations

# kohya name (lower case) -> (module, class, canonical name)
OPTIMIZERS: dict[str, tuple[str, str, str]] = {
    "adamw": ("torch.optim", "AdamW", "AdamW"),
    "adamw8bit": ("bitsandbytes.optim", "AdamW8bit", "AdamW8bit"),
    "pagedadamw8bit": ("bitsandbytes.optim", "PagedAdamW8bit", "PagedAdamW8bit"),
    "pagedadamw": ("bitsandbytes.optim", "PagedAdamW", "PagedAdamW"),
    "pagedadamw32bit": ("bitsandbytes.optim", "PagedAdamW32bit", "PagedAdamW32bit"),
    "lion": ("bitsandbytes.optim", "Lion32bit", "Lion"),
    "lion8bit": ("bitsandbytes.optim", "Lion8bit", "Lion8bit"),
    "pagedlion8bit": ("bitsandbytes.optim", "PagedLion8bit", "PagedLion8bit"),
    "prodigy": ("prodigyopt", "Prodigy", "Prodigy"),
    "adafactor": ("transformers.optimization", "Adafactor", "Adafactor"),
}
# optimizers whose step reads sums over all of the LoRA's parameters (Prodigy's estimate of d): with their state split
# across processes (ZeRO), each would estimate from its own share and the LoRA would differ from a whole state's
# (measured: tiny-flux, 8 steps, 2 processes: max difference 0.196 in lora_up weights of at most 0.215)
SUMS_OVER_ALL_PARAMETERS = frozenset({"prodigy"})
SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
              "piecewise_constant", "adafactor")


def state_splits(name: str) -> bool:
    """Whether the optimizer ``name`` (kohya's, any case) gives the same update with its state split across
    processes, each stepping its own share of the parameters (an element-wise or per-tensor update)."""
    return name.lower() not in SUMS_OVER_ALL_PARAMETERS


def optimizer_names() -> list[str]:
    return [canonical for _, _, canonical in OPTIMIZERS.values()]
