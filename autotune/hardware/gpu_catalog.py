"""GPU catalogue: the rates NVML does not report (tensor TFLOP/s, memory bandwidth), per card.

The figures live in ``autotune/data/gpus.toml`` (data, not code; its header says which datasheet figure each
field holds). This module reads that file and resolves a card name as a user types it or as NVML reports it:

- exact match on a name or alias (case-insensitive);
- else a normalised match: vendor words (NVIDIA, GeForce, Tesla, AMD, Radeon) and the RTX/GTX/RX series prefix
  are dropped, punctuation and spaces removed, and a memory size token ("16GB") taken out as a VRAM filter, so
  "3060", "rtx3060" and "NVIDIA GeForce RTX 3060" are one key, and "4060 Ti 16GB" picks the 16 GB card;
- when several cards share a key ("4060 Ti", "V100"), the one with the least VRAM, then the lowest fp16 rate,
  wins: a plan made for it also fits the others;
- an unknown name is a ``UserError`` that lists the close matches (difflib).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path

from sd_scripts_compat.facts.errors import UserError

CATALOG_PATH = Path(__file__).resolve().parents[1] / "data" / "gpus.toml"

# Words that say who made the card, not which card it is. "quadro" stays: Quadro RTX 6000 is not RTX 6000 Ada.
_VENDOR_WORDS = ("nvidia", "geforce", "tesla", "amd", "radeon", "ati")
_SERIES_PREFIXES = ("rtx", "gtx", "rx")
_VRAM_TOKEN = re.compile(r"(?<![a-z0-9.])(\d+(?:\.\d+)?)\s*gb\b")
_REQUIRED = ("name", "aliases", "vendor", "architecture", "vram_gb", "bf16", "fp8", "fp32_tflops",
             "memory_bandwidth_gbs", "source")
_OPTIONAL = ("compute_capability", "gfx_arch", "fp16_tensor_tflops", "bf16_tensor_tflops", "pcie_gbps")


@dataclass(frozen=True)
class GpuSpec:
    """One catalogue card. Rates are dense, at reference boost clock, fp16/bf16 with FP32 accumulate."""

    name: str
    aliases: tuple[str, ...]
    vendor: str  # "nvidia" | "amd"
    architecture: str
    vram_gb: float
    compute_capability: str | None  # "8.6"; None for AMD
    gfx_arch: str | None  # "gfx1100"; None for NVIDIA
    bf16: bool
    fp8: bool
    fp16_tensor_tflops: float | None  # None: no tensor cores (Pascal)
    bf16_tensor_tflops: float | None  # None: no bf16 tensor path
    fp32_tflops: float
    memory_bandwidth_gbs: float
    source: str
    pcie_gbps: float | None = None  # host link, per direction (block swap moves weights over it)
    # probed: this machine's cards NVLinked in blocks of this many, in their order (1: none), and the GB/s each way
    # the least-linked card's NVLinks carry into its block (hardware.gpu_links)
    nvlink_group: int = 1
    nvlink_gbps: float | None = None

    @property
    def cc_tuple(self) -> tuple[int, int] | None:
        """Compute capability as (major, minor), for comparisons such as ``>= (8, 0)``."""
        if self.compute_capability is None:
            return None
        major, minor = self.compute_capability.split(".")
        return int(major), int(minor)


def load_catalog(path: Path | None = None) -> list[GpuSpec]:
    """Read the catalogue file (default: the one shipped in the package), in file order.

    A malformed entry raises ``UserError`` naming the file and the entry, so an edited catalogue fails loudly.
    """
    import toml

    path = Path(path) if path is not None else CATALOG_PATH
    try:
        data = toml.load(path)
    except (OSError, toml.TomlDecodeError) as error:
        raise UserError(f"{path}: cannot read the GPU catalogue ({error}); restore it from the package") from error
    entries = data.get("gpu")
    if not isinstance(entries, list) or not entries:
        raise UserError(f"{path}: no [[gpu]] tables; each card is a [[gpu]] table")
    specs = []
    for number, entry in enumerate(entries, start=1):
        specs.append(_spec_from_entry(entry, path, number))
    names = [spec.name for spec in specs]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise UserError(f"{path}: card names must be unique, repeated: {', '.join(duplicates)}")
    return specs


def _spec_from_entry(entry: dict, path: Path, number: int) -> GpuSpec:
    label = f"{path}: [[gpu]] #{number} ({entry.get('name', '?')})"
    missing = [key for key in _REQUIRED if key not in entry]
    if missing:
        raise UserError(f"{label}: missing key(s) {', '.join(missing)}")
    unknown = sorted(set(entry) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise UserError(f"{label}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(_REQUIRED + _OPTIONAL)}")
    if entry["vendor"] not in ("nvidia", "amd"):
        raise UserError(f"{label}: vendor must be 'nvidia' or 'amd', not {entry['vendor']!r}")
    cc = entry.get("compute_capability")
    if entry["vendor"] == "nvidia" and not (isinstance(cc, str) and re.fullmatch(r"\d+\.\d", cc)):
        raise UserError(f"{label}: an NVIDIA card needs compute_capability as a string like \"8.6\"")

    def number_or_none(key: str) -> float | None:
        value = entry.get(key)
        return None if value is None else float(value)

    return GpuSpec(
        name=str(entry["name"]),
        aliases=tuple(str(alias) for alias in entry["aliases"]),
        vendor=entry["vendor"],
        architecture=str(entry["architecture"]),
        vram_gb=float(entry["vram_gb"]),
        compute_capability=cc,
        gfx_arch=entry.get("gfx_arch"),
        bf16=bool(entry["bf16"]),
        fp8=bool(entry["fp8"]),
        fp16_tensor_tflops=number_or_none("fp16_tensor_tflops"),
        bf16_tensor_tflops=number_or_none("bf16_tensor_tflops"),
        fp32_tflops=float(entry["fp32_tflops"]),
        memory_bandwidth_gbs=float(entry["memory_bandwidth_gbs"]),
        source=str(entry["source"]),
        pcie_gbps=number_or_none("pcie_gbps"),
    )


def normalize_gpu_name(name: str) -> tuple[str, float | None]:
    """``"NVIDIA GeForce RTX 4060 Ti 16GB"`` -> ``("4060ti", 16.0)``: the match key and the VRAM token, if any."""
    text = name.casefold().replace("_", " ")
    text = re.sub(r"[^a-z0-9.]+", " ", text)
    vram = None
    found = _VRAM_TOKEN.search(text)
    if found:
        vram = float(found.group(1))
        text = text[: found.start()] + " " + text[found.end():]
    words = [word for word in text.split() if word not in _VENDOR_WORDS]
    key = "".join(words).replace(".", "")
    for prefix in _SERIES_PREFIXES:
        if key.startswith(prefix) and key[len(prefix):][:1].isdigit():
            key = key[len(prefix):]
            break
    return key, vram


def _vram_close(a: float, b: float) -> bool:
    """Same memory size, allowing for NVML's figure: GiB, less the driver's reservation and ECC's 1/16
    (an "80GB" H100 reports 79.6, a 24 GB A10 with ECC on 22.5)."""
    return abs(a - b) <= max(1.0, 0.08 * max(a, b))


def find_gpu(name: str, vram_gb: float | None = None, catalog: list[GpuSpec] | None = None) -> GpuSpec | None:
    """The catalogue card ``name`` means, or None. ``vram_gb`` (e.g. NVML's total) picks between sizes.

    A VRAM size inside the name ("3060 8GB") must match a card; ``vram_gb`` picks the closest size among the cards
    with the name's key and must also lie within tolerance, so an unlisted variant is not given another's rates.
    """
    catalog = load_catalog() if catalog is None else catalog
    wanted = name.strip().casefold()
    for spec in catalog:
        if wanted == spec.name.casefold() or wanted in (alias.casefold() for alias in spec.aliases):
            if vram_gb is None or _vram_close(spec.vram_gb, vram_gb):
                return spec
    key, token_vram = normalize_gpu_name(name)
    if not key:
        return None
    candidates = [spec for spec in catalog if key in _keys(spec)]
    for size in (token_vram, vram_gb):
        if size is not None and candidates:
            candidates = [spec for spec in candidates if _vram_close(spec.vram_gb, size)]
            target_gb = size
            candidates.sort(key=lambda spec: abs(spec.vram_gb - target_gb))
            candidates = [spec for spec in candidates if spec.vram_gb == candidates[0].vram_gb]
    if not candidates:
        return None
    return min(candidates, key=lambda spec: (spec.vram_gb, spec.fp16_tensor_tflops or spec.fp32_tflops))


def _keys(spec: GpuSpec) -> set[str]:
    return {normalize_gpu_name(text)[0] for text in (spec.name, *spec.aliases)}


def lookup_gpu(name: str, vram_gb: float | None = None, catalog: list[GpuSpec] | None = None) -> GpuSpec:
    """Like ``find_gpu`` but an unknown name is a ``UserError`` listing the closest catalogue names."""
    catalog = load_catalog() if catalog is None else catalog
    stray = re.search(r"[^A-Za-z0-9 ._()+/-]", name)
    if stray:  # a name the matching would read without that character ("RTX 4090 \u2603" is no RTX 4090)
        raise UserError(f"unknown GPU {name!r}: {stray.group()!r} is in no card's name; write it as the catalogue "
                        "does, e.g. 'RTX 4090'")
    spec = find_gpu(name, vram_gb=vram_gb, catalog=catalog)
    if spec is not None:
        return spec
    raise UserError(f"unknown GPU {name!r}: {close_matches_hint(name, catalog)}")


def close_matches(name: str, catalog: list[GpuSpec], limit: int = 5) -> list[str]:
    """Catalogue names that look like ``name`` (difflib on the normalised keys), best first."""
    by_key: dict[str, str] = {}
    for spec in catalog:
        for key in sorted(_keys(spec)):
            by_key.setdefault(key, spec.name)
    key, _ = normalize_gpu_name(name)
    matches = difflib.get_close_matches(key or name.casefold(), list(by_key), n=limit * 3, cutoff=0.5)
    names: list[str] = []
    for match in matches:
        if by_key[match] not in names:
            names.append(by_key[match])
    return names[:limit]


def close_matches_hint(name: str, catalog: list[GpuSpec]) -> str:
    """One clause for an error line: the close matches, or where the list of known cards is."""
    matches = close_matches(name, catalog)
    if matches:
        return "close matches: " + ", ".join(matches) + " (pass one of them to --gpu)"
    return f"no close match among the {len(catalog)} cards in {CATALOG_PATH.name}; try a model number such as '3060'"
