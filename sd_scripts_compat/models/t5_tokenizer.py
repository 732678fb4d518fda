"""The T5 tokenizer FLUX needs, read only from local files (sd-scripts downloads google/t5-v1_1-xxl's; we never do).

Where it comes from, first hit wins: the ``t5xxl_tokenizer`` option (a folder with tokenizer.json or
spiece.model, or one of those files), a ``tokenizer_2/``, ``t5_tokenizer/`` or ``t5xxl_tokenizer/`` folder
beside the ``t5xxl`` file, a diffusers FLUX folder's ``tokenizer_2/`` (a bare tokenizer.json or a
``tokenizer/`` folder beside it is not taken: in FLUX folders those are CLIP's). A tiny family ships its own small
SentencePiece-style (Unigram) tokenizer in ``data/tiny_t5_tokenizer`` so tests and demos run offline.
``train_unigram_t5_tokenizer`` made that file (and builds tokenizers in test fixtures).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from sd_scripts_compat.facts.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TINY_T5_TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "data" / "tiny_t5_tokenizer"
BESIDE_NAMES = ("tokenizer_2", "t5_tokenizer", "t5xxl_tokenizer")  # folders looked for beside the t5xxl file
TOKENIZER_FILES = ("tokenizer.json", "spiece.model")
T5_SPECIALS = ("<pad>", "</s>", "<unk>")  # T5's ids 0, 1, 2


def _holds_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def find_t5_tokenizer(option: str | os.PathLike[str] | None, t5xxl: str | os.PathLike[str] | None,
                      model_folder: str | os.PathLike[str] | None = None) -> Path | None:
    """The tokenizer folder or file to use (see the module docstring), None when there is none."""
    if option:
        path = Path(option).expanduser()
        if path.is_file() or (path.is_dir() and _holds_tokenizer(path)):
            return path
        raise UserError(f"t5xxl_tokenizer = {path}: no tokenizer.json or spiece.model there; point it at the "
                        "T5 tokenizer folder (e.g. FLUX.1-dev's tokenizer_2/ or google/t5-v1_1-xxl)")
    places = []
    if t5xxl:
        beside = Path(t5xxl).expanduser().parent
        places += [beside / name for name in BESIDE_NAMES]
    if model_folder:
        places.append(Path(model_folder) / "tokenizer_2")
    return next((place for place in places if place.is_dir() and _holds_tokenizer(place)), None)


def missing_tokenizer_message(t5xxl: str | os.PathLike[str] | None) -> str:
    where = Path(t5xxl).expanduser().parent / "tokenizer_2" if t5xxl else Path("tokenizer_2")
    return (f"no T5 tokenizer found for the t5xxl text encoder; copy FLUX.1-dev's tokenizer_2/ folder (tokenizer.json "
            f"or spiece.model) to {where} or name it with t5xxl_tokenizer = \"DIR\" (it is never downloaded)")


def load_t5_tokenizer(source: str | os.PathLike[str], max_length: int) -> PreTrainedTokenizerBase:
    """A ``T5TokenizerFast`` from a folder holding tokenizer.json, or a tokenizer.json, local files only.

    A spiece.model alone is refused: transformers 5 without sentencepiece silently builds a wrong
    tokenizer from it (measured: a junk spiece.model "loads" with 104 tokens).
    """
    from transformers import T5TokenizerFast  # type: ignore[attr-defined]  # lazily exported

    path = Path(source)
    if (path.is_dir() and not (path / "tokenizer.json").is_file()) or (path.is_file() and path.suffix != ".json"):
        raise UserError(f"{path}: a T5 tokenizer is read from its tokenizer.json (a spiece.model alone cannot be "
                        "read safely here); give FLUX.1-dev's tokenizer_2/ folder or its tokenizer.json")
    try:
        if path.is_dir():
            return T5TokenizerFast.from_pretrained(str(path), local_files_only=True, model_max_length=max_length)
        return T5TokenizerFast(tokenizer_file=str(path), model_max_length=max_length, extra_ids=0,
                               eos_token="</s>", unk_token="<unk>", pad_token="<pad>")
    except Exception as exc:  # the tokenizers library raises plain Exception for a malformed tokenizer.json
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"{path}: not a readable T5 tokenizer ({reason[:160]}); give FLUX.1-dev's tokenizer_2/ "
                        "folder or its tokenizer.json") from None


def train_unigram_t5_tokenizer(corpus: Iterable[str], vocab_size: int, max_length: int) -> PreTrainedTokenizerBase:
    """A T5-style tokenizer (Unigram with the SentencePiece ``▁`` word marker, ``</s>`` appended, ids
    <pad>=0 </s>=1 <unk>=2) trained on ``corpus`` with the ``tokenizers`` library: small and offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import T5TokenizerFast  # type: ignore[attr-defined]  # lazily exported

    tokenizer = Tokenizer(models.Unigram())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=list(T5_SPECIALS), unk_token="<unk>")
    tokenizer.train_from_iterator(list(corpus), trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                             special_tokens=[("</s>", 1)])
    return T5TokenizerFast(tokenizer_object=tokenizer, eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
                           extra_ids=0, model_max_length=max_length)


def write_tiny_tokenizer(folder: Path = TINY_T5_TOKENIZER_DIR) -> None:
    """Maintainer step that made the shipped tiny tokenizer (``python -m sd_scripts_compat.models.t5_tokenizer``)."""
    words = ("a photo of dog cat person woman man smiling portrait studio light red blue green chair table "
             "painting drawing style sks ohwx landscape mountain river tree city night day sun moon sky house "
             "car street flower garden beach sea close up wearing hat glasses shirt dress black white bright dark "
             "standing sitting looking at the viewer in on with and high quality detailed")
    split = words.split()
    corpus = [" ".join(split[i:i + 7]) for i in range(len(split))] * 4
    train_unigram_t5_tokenizer(corpus, vocab_size=400, max_length=512).save_pretrained(str(folder))


if __name__ == "__main__":
    write_tiny_tokenizer()
