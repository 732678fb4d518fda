"""What a separate model file holds, from its header alone: the parts sd-scripts' FLUX.1, Chroma and SD3 scripts take
beside the model (``clip_l``, ``clip_g``, ``t5xxl``, ``ae`` / ``vae``), so a page can fill them from the files that
sit beside a model. The markers are the keys the loaders check a given part by (``flux_files``, ``sd3_files``); the
two CLIPs are told apart by their width, as SD3's loader tells them apart (a CLIP of another width, such as a tiny
twin's, by its file name where the family takes two).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

CLIP_WIDTHS = {768: "clip_l", 1280: "clip_g"}  # token embedding width: CLIP-L / OpenCLIP bigG
T5_MARKER = "encoder.block.0.layer.0."
AUTOENCODER_MARKER = "decoder.conv_out.weight"
AUTOENCODER_KEYS = ("ae", "vae")  # FLUX.1 / Chroma name it ae, SD3 vae: the same kind of file
MAX_CANDIDATES = 64  # .safetensors files read beside one model (their headers only)


def part_kind(shapes: Mapping[str, Sequence[int]]) -> str | None:
    """``clip_l``, ``clip_g``, ``clip`` (another width), ``t5xxl``, ``autoencoder`` or None (a model, or a part
    we do not take)."""
    for key, shape in shapes.items():
        if key.endswith("embeddings.token_embedding.weight") and len(shape) == 2:
            return CLIP_WIDTHS.get(int(shape[1]), "clip")
    if any(T5_MARKER in key for key in shapes):
        return "t5xxl"
    if any(key.endswith(AUTOENCODER_MARKER) for key in shapes) and not any(
            key.startswith(("model.diffusion_model.", "first_stage_model.")) for key in shapes):
        return "autoencoder"
    return None


def parts_beside(model: Path, wanted: Sequence[str]) -> dict[str, Path]:
    """The files beside ``model`` that hold the parts ``wanted`` (option names), each where exactly one file of
    its kind is there (two T5 files, fp16 and fp8, leave the choice to the user)."""
    from sd_scripts_compat.models.checkpoint import read_checkpoint

    found: dict[str, list[Path]] = {}
    try:
        candidates = sorted(p for p in model.parent.iterdir() if p.suffix == ".safetensors" and p != model)
    except OSError:
        return {}
    for path in candidates[:MAX_CANDIDATES]:
        try:
            kind = part_kind(read_checkpoint(path, header_only=True).shapes)
        except Exception:  # noqa: BLE001 (a file we cannot read is no candidate; loading it would say why)
            continue
        for option in wanted:
            if _holds(kind, option, path, wanted):
                found.setdefault(option, []).append(path)
    return {option: paths[0] for option, paths in found.items() if len(paths) == 1}


def _holds(kind: str | None, option: str, path: Path, wanted: Sequence[str]) -> bool:
    if kind == "autoencoder":
        return option in AUTOENCODER_KEYS
    if kind == "clip" and option.startswith("clip_"):  # one CLIP wanted: this one; two: the one its name says
        clips = [o for o in wanted if o.startswith("clip_")]
        return len(clips) == 1 or option in path.name
    return kind == option
