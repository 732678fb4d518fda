"""Derive the CLIP BPE tokenizer files (vocab.json + merges.txt) shipped in this folder.

Run once by a maintainer: ``python -m sd_scripts_compat.data.derive_clip_vocab WHEEL_OR_GZ``.
Input is open_clip's ``bpe_simple_vocab_16e6.txt.gz`` (or an open-clip-torch wheel holding it:
``pip download --no-deps open-clip-torch``). We ship the derived files so no tokenizer is ever
fetched from a model hub, and we never install open-clip-torch (it drags in torchvision).
"""

from __future__ import annotations

import gzip
import io
import json
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent / "clip_tokenizer"
MERGE_COUNT = 49152 - 256 - 2  # CLIP keeps this many merges from the file


def byte_to_unicode_table() -> dict[int, str]:
    """GPT-2/CLIP's reversible byte -> printable-unicode table (the BPE alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table  # insertion order (printable bytes first) is the vocabulary order


def read_bpe_text(source: Path) -> str:
    if source.suffix == ".whl":
        with zipfile.ZipFile(source) as wheel:
            name = next(n for n in wheel.namelist() if n.endswith("bpe_simple_vocab_16e6.txt.gz"))
            raw = wheel.read(name)
    else:
        raw = source.read_bytes()
    return gzip.GzipFile(fileobj=io.BytesIO(raw)).read().decode("utf-8")


def derive(bpe_text: str) -> tuple[dict[str, int], list[tuple[str, str]]]:
    merges = [tuple(line.split()) for line in bpe_text.split("\n")[1 : MERGE_COUNT + 1]]
    alphabet = list(byte_to_unicode_table().values())
    tokens = alphabet + [symbol + "</w>" for symbol in alphabet]
    tokens += ["".join(pair) for pair in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return {token: index for index, token in enumerate(tokens)}, merges  # type: ignore[return-value]


def main(argv: list[str]) -> int:
    vocab, merges = derive(read_bpe_text(Path(argv[0])))
    HERE.mkdir(exist_ok=True)
    (HERE / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    lines = ["#version: 0.2"] + [f"{a} {b}" for a, b in merges]
    (HERE / "merges.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"vocab {len(vocab)} tokens, {len(merges)} merges -> {HERE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
