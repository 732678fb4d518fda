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
SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
              "piecewise_constant", "adafactor")


def optimizer_names() -> list[str]:
    return [canonical for _, _, canonical in OPTIMIZERS.values()]
