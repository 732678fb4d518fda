"""Captions as the engine will read them: found, missing, orphaned, empty; their length in CLIP tokens against
``max_token_length``; the folder's class (trigger) tokens in them; and the tag frequency.

Captions are read with the engine's own reader (``caption_text``, then ``first_line``: what ``read_caption``
trains; an empty file or one that is not UTF-8 is an error there), each file once, and counted with the CLIP
tokenizer the project ships, so the doctor cannot disagree with training about what a caption is.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from autotune.doctor.report import ERROR, WARNING, Problem, rel_name
from sd_scripts_compat.dataset.captions import caption_text, first_line, tag_frequency
from sd_scripts_compat.facts.dataset_scan import CAPTION_EXTENSIONS, SubsetScan
from sd_scripts_compat.facts.errors import UserError

TokenCounter = Callable[[list[str]], list[int]]
CaptionReading = tuple[str | None, Problem | None]  # the caption the engine trains (None: none), what is wrong
CaptionReader = Callable[[list[Path]], dict[Path, CaptionReading]]  # caption files -> their readings
TOKEN_LIMITS = (75, 150, 225)  # kohya's max_token_length None (75) / 150 / 225


@dataclass(frozen=True)
class CaptionFacts:
    found: int
    missing: int
    orphaned: int
    empty: int
    captions: tuple[str, ...]  # per image: what the engine trains it with (caption, else class tokens, else "")
    problems: tuple[Problem, ...]


def shipped_token_counter() -> TokenCounter:
    """Content tokens per caption (BOS/EOS not counted) with the CLIP tokenizer the project ships, no hub."""
    from sd_scripts_compat.models.build import load_tokenizer

    tokenizer = load_tokenizer()

    def count(captions: list[str]) -> list[int]:
        if not captions:
            return []
        ids = tokenizer(captions, add_special_tokens=False, truncation=False, verbose=False).input_ids
        return [len(row) for row in ids]

    return count


def check_captions(subset: SubsetScan, root: Path, extension: str, count_tokens: TokenCounter,
                   max_token_length: int, reader: CaptionReader | None = None) -> CaptionFacts:
    """Every caption check of one subset folder; ``reader`` reads its caption files (default: each one now; the
    doctor's keeps what it read, ``file_facts``)."""
    problems: list[Problem] = []
    captions: list[str] = []
    read: list[tuple[str, str]] = []  # (caption file, text) of the captions that were read
    missing: list[Path] = []
    empty = 0
    files = {image: image.with_name(image.stem + extension) for image in subset.images}
    present = [path for path in files.values() if path.name in subset.listing.files]
    readings = reader(present) if reader is not None else {path: read_caption_file(path, root) for path in present}
    for image, path in files.items():
        if path not in readings:
            missing.append(image)
            problems += _other_extension(subset, image, root, extension)
            captions.append(subset.class_tokens or "")
            continue
        text, problem = readings[path]
        if problem is not None:
            problems.append(problem)
            empty += problem.code in ("caption-empty", "caption-blank")
        if text is not None:
            read.append((rel_name(path, root), text))
        captions.append(text or "")
    problems += _missing(subset, missing, root, extension)
    orphans = _orphans(subset, root)
    problems += orphans
    problems += _token_lengths(read, count_tokens, max_token_length)
    if subset.class_tokens:
        problems += [_no_trigger(rel, subset.class_tokens) for rel, text in read
                     if text and not _contains(text, subset.class_tokens)]
    return CaptionFacts(found=len(subset.images) - len(missing), missing=len(missing), orphaned=len(orphans),
                        empty=empty, captions=tuple(captions), problems=tuple(problems))


def top_tags(captions: tuple[str, ...], count: int) -> tuple[tuple[str, int], ...]:
    """The engine's tag frequency (kohya's ss_tag_frequency rule), most frequent first, ties by name."""
    frequency = tag_frequency(captions)
    return tuple(sorted(frequency.items(), key=lambda item: (-item[1], item[0]))[:count])


def read_caption_file(path: Path, root: Path) -> CaptionReading:
    """The caption the engine reads (its first line), or the error the engine would stop with."""
    rel = rel_name(path, root)
    try:
        whole = caption_text(path)
    except FileNotFoundError:  # gone since the listing
        return None, None
    except OSError as exc:
        return None, Problem(ERROR, "caption-unreadable", rel, f"the caption file cannot be read "
                             f"({exc.__class__.__name__}); the engine stops at it", "fix its permissions or re-save it")
    except UserError:
        if path.stat().st_size == 0:
            return None, Problem(ERROR, "caption-empty", rel, "the caption file is empty; the engine stops at it "
                                 "(an empty file is almost always a tagging accident)",
                                 "write a caption, or delete the file to train the image with the class tokens")
        return None, Problem(ERROR, "caption-not-utf8", rel, "the caption file is not UTF-8; the engine stops at it",
                             "re-save it as UTF-8")
    text = first_line(whole)
    if not text:
        return "", Problem(WARNING, "caption-blank", rel, "the first line is blank and the engine reads only the "
                           "first line, so the image trains with an empty caption", "put the caption on the first line")
    lines = [line for line in whole.splitlines() if line.strip()]
    if len(lines) > 1:
        return text, Problem(WARNING, "caption-multiline", rel, f"{len(lines)} lines: the engine reads only the "
                             "first, the rest is never trained", "join the lines into one, separated by commas")
    return text, None


def _other_extension(subset: SubsetScan, image: Path, root: Path, extension: str) -> list[Problem]:
    """A caption beside the image with another caption extension: the engine never reads it."""
    variants = dict.fromkeys(v for ext in CAPTION_EXTENSIONS for v in (ext, ext.upper()) if v != extension)
    return [Problem(WARNING, "caption-other-extension", rel_name(other, root),
                    f"not read: the captions read are {extension} (caption_extension; file names are case-sensitive)",
                    f"rename it to {image.stem}{extension}, or set caption_extension = \"{other.suffix}\"")
            for other in (image.with_name(image.stem + ext) for ext in variants)
            if other.name in subset.listing.files]


def _missing(subset: SubsetScan, missing: list[Path], root: Path, extension: str) -> list[Problem]:
    """Images without a caption: one problem for a folder that has none at all, else one per image."""
    if not missing:
        return []
    tokens = subset.class_tokens
    trains = f"the class tokens '{tokens}' as its whole caption" if tokens else \
        "an empty caption (the folder name gives no class tokens)"
    fix = f"write a {extension} caption beside each image (e.g. with a tagger)"
    if len(missing) == len(subset.images):
        return [Problem(WARNING, "caption-none", rel_name(subset.folder, root) if subset.folder != root else ".",
                        f"no {extension} captions: every image trains with {trains}", fix)]
    return [Problem(WARNING, "caption-missing", rel_name(image, root), f"no {image.stem}{extension}: it trains with "
                    f"{trains}", fix) for image in missing]


def _orphans(subset: SubsetScan, root: Path) -> list[Problem]:
    """Caption files whose image is not there (or is in a format the engine does not read)."""
    stems = {image.stem for image in subset.images}
    files = [(name, *os.path.splitext(name)) for name in sorted(subset.listing.files)]  # names: no Path per file
    other_files: dict[str, list[str]] = {}
    for name, stem, suffix in files:
        if suffix not in CAPTION_EXTENSIONS:
            other_files.setdefault(stem, []).append(name)
    problems = []
    for name, stem, suffix in files:
        if suffix not in CAPTION_EXTENSIONS or stem in stems:
            continue
        others = other_files.get(stem, [])
        why = f"its image {others[0]} is a format the engine does not read" if others else \
            f"there is no image {stem}.* beside it"
        problems.append(Problem(WARNING, "caption-orphan", rel_name(subset.folder / name, root),
                                f"caption without an image: {why}, so it is never read",
                                "add or convert the image, or delete the caption"))
    return problems


def _token_lengths(read: list[tuple[str, str]], count_tokens: TokenCounter, limit: int) -> list[Problem]:
    problems = []
    for (rel, _), tokens in zip(read, count_tokens([text for _, text in read])):
        if tokens <= limit:
            continue
        wider = next((n for n in TOKEN_LIMITS if n >= tokens), None)
        fix = f"shorten it, or set max_token_length = {wider}" if wider else \
            f"shorten it to {TOKEN_LIMITS[-1]} tokens or fewer ({TOKEN_LIMITS[-1]} is the most kohya allows)"
        problems.append(Problem(WARNING, "caption-too-long", rel, f"{tokens} CLIP tokens: the text encoder reads "
                                f"the first {limit} (max_token_length {limit}) and the rest is cut", fix))
    return problems


def _contains(text: str, tokens: str) -> bool:
    """The class tokens appear as whole words, in any letter case."""
    return re.search(rf"(?<!\w){re.escape(tokens.strip())}(?!\w)", text, re.IGNORECASE) is not None


def _no_trigger(rel: str, tokens: str) -> Problem:
    return Problem(WARNING, "trigger-missing", rel, f"the caption lacks the class tokens '{tokens}' (from the folder "
                   "name); a caption file replaces them, so this image does not teach the LoRA its trigger",
                   f"start the caption with '{tokens}, '")
