"""Sample prompts in kohya's syntax (``sample_prompts``): the lines, .toml and .json files sd-scripts' ``load_prompts``
reads, each prompt checked and sized as sd-scripts renders it. Torch-free: the tuner may check a prompt file
before a run, and each family runtime's renderer reads ``SamplePrompt``.

A prompt file line is ``a prompt --n negative --w 512 --h 512 --s 20 --l 7.5 --d 42``; lines starting
with ``#`` are comments. A ``.toml`` file holds ``[prompt]`` defaults and ``[[prompt.subset]]`` prompts, a ``.json``
file a list of such tables (or of prompt lines), by kohya's keys (``prompt``, ``negative_prompt``, ``width``,
``height``, ``sample_steps``, ``scale``, ``seed``, ``guidance_scale``).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sd_scripts_compat.facts.errors import UserError

_OPTION = re.compile(r"\s--(n|w|h|s|l|d|g)\s+")


@dataclass(frozen=True)
class SamplePrompt:
    prompt: str
    negative_prompt: str = ""
    width: int = 512
    height: int = 512
    steps: int = 30
    guidance_scale: float = 7.5
    seed: int | None = None
    guidance: float | None = None  # FLUX.1's guidance embedding (sd-scripts' --g); None: the config's


def parse_prompt_line(line: str, default: SamplePrompt) -> SamplePrompt:
    parts = _OPTION.split(" " + line.strip())
    sample = replace(default, prompt=parts[0].strip())
    fields = {"n": ("negative_prompt", str), "w": ("width", int), "h": ("height", int), "s": ("steps", int),
              "l": ("guidance_scale", float), "d": ("seed", int), "g": ("guidance", float)}
    for flag, value in zip(parts[1::2], parts[2::2]):
        name, cast = fields[flag]
        try:
            sample = replace(sample, **{name: cast(value.strip())})
        except ValueError:
            raise UserError(f"sample prompt {line.strip()!r}: --{flag} needs a {cast.__name__}") from None
    return _checked(sample, line)


def _checked(sample: SamplePrompt, line: str) -> SamplePrompt:
    """A prompt's values checked (``_check_ranges``) and its size rounded as sd-scripts renders it."""
    _check_ranges(sample, line)
    return _sizes_as_sd_scripts_rounds(sample, line)


MAX_SAMPLE_SIDE = 8192  # px: a larger sample would take the card (or this CPU) hours, not a preview
MAX_SAMPLE_STEPS = 1000


def _check_ranges(sample: SamplePrompt, line: str) -> None:
    """Values that would crash, hang or silently do something else, said before training."""
    import math

    checks = (("w", sample.width, 1 <= sample.width <= MAX_SAMPLE_SIDE, f"a width in 1..{MAX_SAMPLE_SIDE} px"),
              ("h", sample.height, 1 <= sample.height <= MAX_SAMPLE_SIDE, f"a height in 1..{MAX_SAMPLE_SIDE} px"),
              ("s", sample.steps, 1 <= sample.steps <= MAX_SAMPLE_STEPS, f"1..{MAX_SAMPLE_STEPS} steps"),
              ("l", sample.guidance_scale, math.isfinite(sample.guidance_scale) and sample.guidance_scale >= 0,
               "a finite scale of 0 or more"),
              ("g", sample.guidance, sample.guidance is None or (math.isfinite(sample.guidance)
                                                                   and sample.guidance >= 0), "a finite guidance >= 0"),
              ("d", sample.seed, sample.seed is None or 0 <= sample.seed < 2**63, "a seed in 0..2^63-1"))
    for flag, value, ok, wanted in checks:
        if not ok:
            raise UserError(f"sample prompt {line.strip()[:80]!r}: --{flag} {value}: give {wanted}")


def _sizes_as_sd_scripts_rounds(sample: SamplePrompt, line: str) -> SamplePrompt:
    """sd-scripts renders at ``max(64, size - size % 8)``; a size it would change is changed here too, and said
    (the VAE needs multiples of 8: the exact size used to crash the first sample after minutes of training)."""
    width, height = (max(64, size - size % 8) for size in (sample.width, sample.height))
    if (width, height) != (sample.width, sample.height):
        warnings.warn(f"sample prompt {line.strip()!r}: {sample.width}x{sample.height} rendered at {width}x{height} "
                      "(multiples of 8, at least 64, as sd-scripts renders)", stacklevel=2)
    return replace(sample, width=width, height=height)


# sd-scripts' prompt-table keys (load_prompts / line_to_prompt_dict) -> SamplePrompt's fields, with their types
PROMPT_KEYS: dict[str, tuple[str, type]] = {
    "prompt": ("prompt", str), "negative_prompt": ("negative_prompt", str), "width": ("width", int),
    "height": ("height", int), "sample_steps": ("steps", int), "scale": ("guidance_scale", float),
    "seed": ("seed", int), "guidance_scale": ("guidance", float), "enum": ("", int), "subset": ("", list)}


def read_sample_prompts(path: str | Path, resolution: tuple[int, int]) -> list[SamplePrompt]:
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".txt", ".toml", ".json"):
        raise UserError(f"{path}: sample prompts are a .txt (one prompt per line), .toml or .json file, as in "
                        "sd-scripts")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise UserError(f"{path}: cannot read sample prompts ({error.strerror})") from None
    except UnicodeDecodeError as error:
        raise UserError(f"{path}: sample prompts are not UTF-8 (byte {error.start}); re-save the file as "
                        "UTF-8") from None
    default = SamplePrompt(prompt="", width=resolution[0], height=resolution[1])
    if suffix == ".txt":
        lines = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        return [parse_prompt_line(line, default) for line in lines]
    return _prompt_tables(path, text, default)


def _prompt_tables(path: Path, text: str, default: SamplePrompt) -> list[SamplePrompt]:
    """The prompts of a .toml / .json prompt file (sd-scripts' ``load_prompts``): tables, or prompt lines."""
    import json

    import toml

    try:
        if path.suffix.lower() == ".toml":
            table = toml.loads(text).get("prompt")
            if not isinstance(table, dict) or not isinstance(table.get("subset"), list):
                raise UserError(f"{path}: a .toml prompt file has [prompt] and [[prompt.subset]] tables")
            entries: Any = [{**table, **subset} if isinstance(subset, dict) else subset for subset in table["subset"]]
        else:
            entries = json.loads(text)
    except (ValueError, TypeError, RecursionError) as error:
        raise UserError(f"{path}: not a valid {path.suffix.lower()[1:]} prompt file ({str(error)[:120]})") from None
    if not isinstance(entries, list):
        raise UserError(f"{path}: a .json prompt file is a list of prompt tables or lines")
    return [parse_prompt_line(entry, default) if isinstance(entry, str) else _prompt_from_table(path, entry, default)
            for entry in entries]


def _prompt_from_table(path: Path, table: Any, default: SamplePrompt) -> SamplePrompt:
    if not isinstance(table, dict):
        raise UserError(f"{path}: each prompt is a table (prompt, width, height, ...) or a line, got {table!r:.40}")
    fields: dict[str, Any] = {}
    for key, value in table.items():
        if key not in PROMPT_KEYS:
            raise UserError(f"{path}: prompt key {key!r} is not one sd-scripts reads; use "
                            f"{', '.join(k for k in PROMPT_KEYS if PROMPT_KEYS[k][0])}")
        field, kind = PROMPT_KEYS[key]
        if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else kind):
            raise UserError(f"{path}: prompt key {key} = {value!r:.40}: give a {kind.__name__}")
        if field:
            fields[field] = value
    sample = replace(default, **fields)
    return _checked(sample, f"{path.name}: {sample.prompt[:60]}")
