"""Captions as sd-scripts reads and perturbs them, with every random choice from an explicit RNG.

kohya draws from Python's global ``random`` module, so a resumed run or a different worker count
changes the captions. Here each call takes a ``random.Random``; the dataset seeds one per sample
from (seed, epoch, step, position), which makes captions reproducible and resumable.
"""

from __future__ import annotations

import math
import random
import warnings
from collections.abc import Iterable
from pathlib import Path

from sd_scripts_compat.facts.dataset_spec import SubsetSpec
from sd_scripts_compat.facts.errors import UserError


def read_caption(image_path: str | Path, caption_extension: str) -> str | None:
    """First line (stripped) of ``<stem><caption_extension>`` beside the image, or None when absent.

    Like sd-scripts, an existing but empty file is an error (it is almost always a tagging
    accident), and so is a file that is not UTF-8. Unlike sd-scripts, a UTF-8 byte-order mark (Windows
    Notepad writes one) is dropped rather than glued to the first tag.
    """
    path = Path(image_path)
    caption_path = path.with_name(path.stem + caption_extension)
    if not caption_path.is_file():
        return None
    return first_line(caption_text(caption_path))


def caption_text(caption_path: Path) -> str:
    """A caption file's whole text as ``read_caption`` reads it (a byte-order mark dropped); a one-line UserError
    for a file that is empty or not UTF-8."""
    try:
        text = caption_path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UserError(f"{caption_path}: caption file is not UTF-8 ({exc.reason}); re-save it as UTF-8") from None
    if text == "":
        raise UserError(f"{caption_path}: caption file is empty; write a caption or delete the file "
                        "to fall back to the class tokens")
    return text


def first_line(text: str) -> str:
    """What trains of a caption file's text: its first line, stripped."""
    return text.splitlines()[0].strip() if text.splitlines() else ""


def base_caption(image_path: str | Path, subset: SubsetSpec, warn: bool = True) -> tuple[str, bool]:
    """(caption, missing): the caption file's line, else the subset's class tokens, else "" (with a
    warning unless ``warn=False``, for callers that summarise per folder)."""
    caption = read_caption(image_path, subset.caption_extension)
    if caption is not None:
        return caption, False
    if subset.class_tokens is not None:
        return subset.class_tokens, True
    if warn:
        warnings.warn(f"{image_path}: neither a {subset.caption_extension} caption file nor class tokens; "
                      "training it with an empty caption", stacklevel=2)
    return "", True


def _split_tags(text: str, separator: str) -> list[str]:
    return [t.strip() for t in text.split(separator) if t.strip()]


def process_caption(caption: str, subset: SubsetSpec, rng: random.Random, *, epoch: int = 0, step: int = 0,
                    max_train_steps: int = 0) -> str:
    """Apply the subset's caption options to one caption, in sd-scripts' order.

    prefix/suffix -> whole-caption dropout (``caption_dropout_rate``, or every
    ``caption_dropout_every_n_epochs``-th epoch) -> only the first line -> split on
    ``caption_separator`` into fixed tokens (the first ``keep_tokens``, or everything before
    ``keep_tokens_separator``, and everything after a second separator as a fixed suffix) and flex
    tokens -> token warm-up -> shuffle the flex tokens -> drop each flex tag with
    ``caption_tag_dropout_rate`` -> join with ", ".
    """
    if subset.caption_prefix:
        caption = subset.caption_prefix + " " + caption
    if subset.caption_suffix:
        caption = caption + " " + subset.caption_suffix

    dropped = subset.caption_dropout_rate > 0 and rng.random() < subset.caption_dropout_rate
    every = subset.caption_dropout_every_n_epochs
    if dropped or (every > 0 and epoch % every == 0):
        return ""

    caption = caption.split("\n")[0]
    warmup_steps = subset.token_warmup_step
    if warmup_steps < 1:  # a fraction of the run, like sd-scripts
        warmup_steps = math.floor(warmup_steps * max_train_steps)
    if not (subset.shuffle_caption or warmup_steps > 0 or subset.caption_tag_dropout_rate > 0):
        return caption

    separator = subset.caption_separator
    fixed: list[str] = []
    fixed_suffix: list[str] = []
    keep_sep = subset.keep_tokens_separator
    if keep_sep and keep_sep in caption:
        fixed_part, flex_part = caption.split(keep_sep, 1)
        if keep_sep in flex_part:
            flex_part, suffix_part = flex_part.split(keep_sep, 1)
            fixed_suffix = _split_tags(suffix_part, separator)
        fixed = _split_tags(fixed_part, separator)
        flex = _split_tags(flex_part, separator)
    else:
        tokens = [t.strip() for t in caption.strip().split(separator)]
        flex = tokens
        if subset.keep_tokens > 0:
            fixed, flex = tokens[: subset.keep_tokens], tokens[subset.keep_tokens:]

    if warmup_steps and step < warmup_steps:
        count = math.floor(step * ((len(flex) - subset.token_warmup_min) / warmup_steps)) + subset.token_warmup_min
        flex = flex[:count]
    if subset.shuffle_caption:
        rng.shuffle(flex)
    if subset.caption_tag_dropout_rate > 0:
        flex = [t for t in flex if rng.random() >= subset.caption_tag_dropout_rate]
    return ", ".join(fixed + flex + fixed_suffix)


# the subset keys that make a processed caption change between steps
CAPTION_RANDOMIZING_KEYS = ("shuffle_caption", "caption_dropout_rate", "caption_tag_dropout_rate", "token_warmup_step",
                            "caption_dropout_every_n_epochs")


def caption_is_deterministic(subset: SubsetSpec) -> str | None:
    """None when the subset's processed caption never changes (so text-encoder outputs may be cached);
    otherwise the name of the key that makes it random."""
    for key in CAPTION_RANDOMIZING_KEYS:
        if getattr(subset, key):
            return key
    return None


def tag_frequency(captions: Iterable[str]) -> dict[str, int]:
    """Tag counts for ``ss_tag_frequency``: comma-split, stripped, lower-cased, empty tags skipped."""
    counts: dict[str, int] = {}
    for caption in captions:
        for tag in caption.split(","):
            tag = tag.strip().lower()
            if tag:
                counts[tag] = counts.get(tag, 0) + 1
    return counts
