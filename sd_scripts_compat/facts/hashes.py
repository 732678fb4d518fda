"""The hashes the tools around LoRA files compare by, computed one way: a file's SHA-256 read 1 MiB at a time
(AUTOMATIC1111's new model hash, the latent cache's image check, the doctor's duplicate images), and
AUTOMATIC1111's legacy hash, the first 8 hex digits of the SHA-256 of the 64 KiB at 1 MiB (of a buffer, for
``sshs_legacy_hash``; of a file, for ``ss_sd_model_hash``)."""

from __future__ import annotations

import hashlib
import os

LEGACY_OFFSET = 0x100000  # 1 MiB
LEGACY_LENGTH = 0x10000  # 64 KiB
BLOCK_BYTES = 1 << 20


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The whole file's SHA-256, read ``BLOCK_BYTES`` at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(BLOCK_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()


def legacy_hash(data: bytes) -> str:
    """The legacy hash of ``data`` (a whole buffer, or a file's first ``LEGACY_OFFSET + LEGACY_LENGTH`` bytes; the
    window is empty when it is shorter)."""
    return hashlib.sha256(memoryview(data)[LEGACY_OFFSET:LEGACY_OFFSET + LEGACY_LENGTH]).hexdigest()[:8]


def file_legacy_hash(path: str | os.PathLike[str]) -> str:
    with open(path, "rb") as handle:
        return legacy_hash(handle.read(LEGACY_OFFSET + LEGACY_LENGTH))
