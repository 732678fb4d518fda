"""What a separate model file holds, from its header alone: the parts the trainers take beside the model (sd-scripts'
``clip_l``, ``clip_g``, ``t5xxl``, ``ae`` / ``vae``, ``gemma2``, ``qwen3``, ``text_encoder``, ``byt5``; musubi-tuner's
``vae``, ``text_encoder``), so a page can fill them from the files that sit beside a model and name a file given for
the wrong one. The markers are the keys the loaders read: CLIP's token embedding (the two CLIPs told apart by width,
as SD3's loader does, or for a twin of another width by the file's name), a T5 encoder's first block (T5-XXL, UMT5,
ByT5), a language model's token embedding (Qwen2.5-VL, Qwen3, Gemma 2, Mistral), an autoencoder's last decoder
convolution (the 2D ``decoder.conv_out`` and Wan / Qwen-Image's 3D ``decoder.head.2``). Two are found by their name
alone (``BY_NAME``): Wan's T5, a ``.pth`` pickle that is never opened here, and Wan 2.2's high-noise expert.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

CLIP_WIDTHS = {768: "clip_l", 1280: "clip_g"}  # token embedding width: CLIP-L / OpenCLIP bigG
T5_MARKER = "encoder.block.0.layer.0."
LLM_MARKER = "embed_tokens.weight"  # model.embed_tokens.weight of a decoder language model
AUTOENCODER_MARKERS = ("decoder.conv_out.weight", "decoder.head.2.weight")  # 2D / Wan and Qwen-Image's 3D layout
AUTOENCODER_KEYS = ("ae", "vae")  # FLUX.1 / Chroma / Lumina name it ae, SD3 and the others vae: one kind of file
# the option -> the kinds of file it takes
OPTION_KINDS: dict[str, tuple[str, ...]] = {
    "clip_l": ("clip_l", "clip"), "clip_g": ("clip_g", "clip"), "t5xxl": ("t5",), "t5": ("t5",), "byt5": ("t5",),
    "ae": ("autoencoder",), "vae": ("autoencoder",), "text_encoder": ("llm",), "qwen3": ("llm",),
    "gemma2": ("llm",)}
KIND_NAMES = {"clip_l": "a CLIP-L text encoder", "clip_g": "a CLIP-G text encoder", "clip": "a CLIP text encoder",
              "t5": "a T5 encoder", "llm": "a language model", "autoencoder": "an autoencoder"}
MAX_CANDIDATES = 64  # .safetensors files read beside one model (their headers only)
# parts told by their file name alone: Wan's T5 is a .pth pickle (never opened here), Wan 2.2's high-noise expert a
# second DiT of the model's own kind
BY_NAME = (("t5", ("t5",), (".pth",)), ("dit_high_noise", ("high_noise", "high-noise"), (".safetensors",)))


def part_kind(shapes: Mapping[str, Sequence[int]]) -> str | None:
    """``clip_l``, ``clip_g``, ``clip`` (another width), ``t5``, ``llm``, ``autoencoder`` or None (a model, or a
    part we do not take)."""
    for key, shape in shapes.items():
        if key.endswith("embeddings.token_embedding.weight") and len(shape) == 2:
            return CLIP_WIDTHS.get(int(shape[1]), "clip")
    if any(T5_MARKER in key for key in shapes):
        return "t5"
    if any(key.endswith(LLM_MARKER) and "encoder." not in key for key in shapes):
        return "llm"
    if any(key.endswith(AUTOENCODER_MARKERS) for key in shapes) and not any(
            key.startswith(("model.diffusion_model.", "first_stage_model.")) for key in shapes):
        return "autoencoder"
    return None


def takes(option: str, kind: str | None) -> bool:
    """Whether a file of ``kind`` can be what ``option`` names (a kind we do not tell apart: yes)."""
    return kind is None or option not in OPTION_KINDS or kind in OPTION_KINDS[option]


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
    for option, words, suffixes in BY_NAME:  # files whose header says nothing we may read: by their name alone
        if option in wanted:
            found.setdefault(option, []).extend(p for p in _siblings(model) if p.suffix in suffixes
                                                and any(w in p.name.lower() for w in words))
    return {option: paths[0] for option, paths in found.items() if len(paths) == 1}


def _siblings(model: Path) -> list[Path]:
    try:
        return sorted(p for p in model.parent.iterdir() if p != model and p.is_file())[:MAX_CANDIDATES * 4]
    except OSError:
        return []


def _holds(kind: str | None, option: str, path: Path, wanted: Sequence[str]) -> bool:
    """``option`` takes this file: its kind fits, and of the wanted options that take this kind it is the only one
    or the one the file's name says (a twin's CLIPs; a kind no two of a family's options share otherwise)."""
    if kind is None or kind not in OPTION_KINDS.get(option, ()):
        return False
    rivals = [other for other in wanted if kind in OPTION_KINDS.get(other, ())]
    return len(rivals) == 1 or option in path.name
