"""Text-encoder output caching (kohya's ``cache_text_encoder_outputs[_to_disk]``): encode each caption once.

A disk file ``<image name>.<key>.te.safetensors`` (named and read in ``dataset.cache_entries``; the key names the
encoders' fingerprint, ``max_token_length``, ``clip_skip`` and dtype) records the caption too and is rebuilt when
it changes or the file is damaged (named in one warning).
An image folder we cannot write to gets its files under ``cache_dir`` instead, as latent caches do.
Encoding itself is ``models.text_encoding``; this module only decides what to encode and where it goes.
"""

from __future__ import annotations

import errno
import random
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sd_scripts_compat.caching.build_lock import images_locked
from sd_scripts_compat.caching.latent_cache import CacheStats, module_fingerprint
from sd_scripts_compat.dataset.cache_entries import (
    TextEntry,
    entry_key,
    folder_writable,
    load_text_file,
    text_cache_path,
    text_problem,
)
from sd_scripts_compat.dataset.captions import caption_is_deterministic, process_caption
from sd_scripts_compat.dataset.train_dataset import ImageRecord, TrainDataset
from sd_scripts_compat.facts.atomic import atomic_path, remove_stale_temp_files
from sd_scripts_compat.facts.contract import disk_full_guard
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.models.text_encoding import check_max_token_length, encode_clip_prompts

if TYPE_CHECKING:
    import torch

    from sd_scripts_compat.models.build import ModelBundle
    from sd_scripts_compat.models.text_encoding import TextConditioning

TE_CACHE_FORMAT = "lora-autotune-te/1"


def _text_metadata(caption: str, key: str, max_token_length: int | None, clip_skip: int | None,
                   dtype: torch.dtype | None) -> dict[str, str]:
    return {"format": TE_CACHE_FORMAT, "caption": caption, "text_encoders": key,
            "max_token_length": str(max_token_length), "clip_skip": str(clip_skip), "dtype": str(dtype)}


def _text_entry_problem(path: Path, expected: dict[str, str]) -> str | None:
    """None: a valid entry; "": absent or of another caption (rebuilt quietly); else what is wrong (named)."""
    from safetensors import safe_open

    if not path.is_file():
        return ""
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
        if any(metadata.get(k) != v for k, v in expected.items()):
            return ""  # the caption changed (the rest is in the file's key)
        return text_problem(load_text_file(path))
    except Exception:  # noqa: BLE001 - truncated or foreign
        return "unreadable"


def _save_text(path: Path, entry: TextEntry, metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    tensors = {"encoder_hidden_states": entry.encoder_hidden_states.contiguous()}
    if entry.pooled is not None:
        tensors["pooled"] = entry.pooled.contiguous()
    if entry.attention_mask is not None:
        tensors["attention_mask"] = entry.attention_mask.contiguous()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with disk_full_guard(path.parent, sum(t.numel() * t.element_size() for t in tensors.values()),
                             f"the text-encoder cache {path.name}"), atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata=metadata)
    except OSError as error:
        if error.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        raise UserError(f"{path.parent}: cannot write the text-encoder cache there ({error.strerror}); "
                        "use cache_text_encoder_outputs without _to_disk") from None


def _encode_captions(unique: list[str], encode: Callable[[list[str]], Any], batch_size: int,
                     progress: Callable[[int], None] | None) -> dict[str, TextEntry]:
    """Each caption's outputs, encoded ``batch_size`` at a time without gradients, held on the CPU."""
    import torch

    encoded: dict[str, TextEntry] = {}
    with torch.no_grad():
        for start in range(0, len(unique), max(1, batch_size)):
            chunk = unique[start: start + max(1, batch_size)]
            out = encode(chunk)
            for i, caption in enumerate(chunk):
                pooled = out.pooled[i].cpu().clone() if out.pooled is not None else None
                mask = getattr(out, "attention_mask", None)
                mask = mask[i].cpu().clone() if mask is not None else None
                encoded[caption] = TextEntry(out.encoder_hidden_states[i].cpu().clone(), pooled, mask)
            if progress is not None:
                progress(0)  # captions, not images: the phase is alive, its image count unchanged
    return encoded


def cache_text_encoder_outputs(dataset: TrainDataset, bundle: ModelBundle, *, device: str | torch.device = "cpu",
                               dtype: torch.dtype | None = None, batch_size: int = 1, to_disk: bool = False,
                               max_token_length: int | None = None, clip_skip: int | None = None,
                               is_main_process: bool = True, cache_dir: Path | None = None,
                               encode: Callable[[list[str]], TextConditioning] | None = None, variant: str = "",
                               progress: Callable[[int], None] | None = None) -> CacheStats:
    """Encode each image's caption once (kohya's ``cache_text_encoder_outputs[_to_disk]``), after which
    the text encoders may leave the device (``latent_cache.offload``). Captions must be fixed:
    shuffle/dropout/warm-up keys are a UserError naming the key, as in sd-scripts. Identical captions
    are encoded once. Disk files ``<image name>.<key>.te.safetensors`` record the caption, the encoders'
    fingerprint, ``max_token_length``, ``clip_skip`` and dtype, and are rebuilt when any differ; those of
    images in a folder we cannot write to go under ``cache_dir`` (when given). ``encode(captions)`` is the run's
    (its family runtime's encoding; default ``encode_clip_prompts``, SD 1/2/XL); ``max_token_length`` is then the
    length it records (FLUX.1: T5's) and ``variant`` what else changes the outputs (FLUX.1: the T5 mask), so a
    file made otherwise is rebuilt (``runtimes.FamilyRuntime.text_cache_key``)."""
    for subset in dataset.subsets:
        key_name = caption_is_deterministic(subset)
        if key_name is not None:
            raise UserError(f"{key_name} (subset {subset.image_dir}) makes captions change every step, so text "
                            "encoder outputs cannot be cached; turn off one of them")
    length = check_max_token_length(max_token_length) if encode is None else max_token_length
    te_key = "+".join(module_fingerprint(te) for te in bundle.text_encoders) + variant
    captions = {r.index: process_caption(r.caption, dataset.subset_of(r), random.Random(0)) for r in dataset.records}

    def expected(record: ImageRecord) -> dict[str, str]:
        return _text_metadata(captions[record.index], te_key, length, clip_skip, dtype)

    pending: list[ImageRecord] = []
    damaged: list[str] = []
    if to_disk and is_main_process:  # what a killed run left beside the images goes first
        for folder in {text_cache_path(record, "x", where).parent for record in dataset.records
                       for where in (None, cache_dir)}:
            remove_stale_temp_files(folder)
    for record in dataset.records:
        if to_disk:
            key = entry_key({k: v for k, v in expected(record).items() if k != "caption"})
            path = text_cache_path(record, key)
            if cache_dir is not None and not folder_writable(path.parent) \
                    and _text_entry_problem(path, expected(record)) is not None:
                path = text_cache_path(record, key, cache_dir)
            dataset.text_files[record.index] = path
            dataset.text_outputs.pop(record.index, None)
            if not is_main_process:
                continue
            problem = _text_entry_problem(path, expected(record))
            if problem is None:
                continue
            if problem:
                damaged.append(f"{path.name}: {problem}")
        pending.append(record)
    if to_disk and not is_main_process:
        return CacheStats(0, 0)
    if damaged:
        more = f" and {len(damaged) - 3} more" if len(damaged) > 3 else ""
        warnings.warn(f"rebuilding {len(damaged)} damaged text-encoder cache file(s) ({'; '.join(damaged[:3])}{more})",
                      stacklevel=2)

    unique = sorted({captions[r.index] for r in pending})
    if unique:
        for encoder in bundle.text_encoders:
            encoder.to(device=device) if dtype is None else encoder.to(device=device, dtype=dtype)
    def clip_encode(chunk: list[str]) -> TextConditioning:
        return encode_clip_prompts(bundle, chunk, max_token_length=length, clip_skip=clip_skip, dtype=dtype)

    encoded = _encode_captions(unique, encode or clip_encode, batch_size, progress)
    for caption, entry in encoded.items():
        if text_problem(entry):
            raise UserError(f"the text encoders gave outputs that are not finite for the caption {caption[:60]!r} in "
                            f"{str(dtype).removeprefix('torch.')}; train in float32 or bf16 (mixed_precision)")
    for record in pending:
        entry = encoded[captions[record.index]]
        if to_disk:
            with images_locked([record.path]):  # one writer at a time; the contents are the same
                _save_text(dataset.text_files[record.index], entry, expected(record))
        else:
            dataset.text_outputs[record.index] = entry
    return CacheStats(encoded=len(unique), reused=len(dataset.records) - len(pending))
