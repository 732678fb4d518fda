"""``network_args`` as sd-scripts' network modules read them, typed once at the config edge.

sd-scripts hands ``network_args = ["conv_dim=4", ...]`` to ``create_network(**kwargs)`` as strings and
each module picks the keys it knows (``data/kohya_network_args.tsv``: every key each module reads);
an unknown key is silently ignored there. Here every entry is checked before anything loads: a key the
module reads is converted to its type (:class:`NetworkArgs`), a key it reads that this engine does not
implement is refused with the reason, a key it does not read is refused with the nearest known one.
Block learning-rate weights and block dims follow ``networks/lora.py``'s rules (SD 1/2: 12 down,
1 mid, 12 up = 25 blocks; SDXL: 1 + 9 + 3 + 9 + 1 = 23), resolved here to one value per block.
``lycoris.kohya`` entries are passed to lycoris-lora unchanged (it reads them itself); only ``algo``
is checked here.
"""

from __future__ import annotations

import csv
import difflib
import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any

from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.kohya_args import DATA_DIR

LYCORIS_MODULE = "lycoris.kohya"
# lycoris-lora's kohya entry point: the algorithms that train here (all wrap Linear / Conv2d)
LYCORIS_ALGOS = ("lora", "locon", "loha", "lokr", "dylora", "full", "ia3", "diag-oft", "boft", "glora")

# every network_args key lycoris-lora 3.x's kohya entry point and its modules read (``kwargs.get`` in its source,
# deprecated spellings included): anything else it would silently ignore
LYCORIS_KEYS = ("algo", "block_size", "bypass_mode", "constrain", "constraint", "conv_alpha", "conv_dim",
                "decompose_both", "disable_conv_cp", "dora_wd", "dropout", "factor", "full_matrix",
                "loraplus_lr_ratio", "loraplus_text_encoder_lr_ratio", "loraplus_unet_lr_ratio", "module_dropout",
                "preset", "rank_dropout", "rescaled", "rs_lora", "train_norm", "train_t5xxl",
                "unbalanced_factorization", "use_conv_cp", "use_cp", "use_scalar", "use_tucker", "wd_on_output")
MISSING_LYCORIS = ('network_module = "lycoris.kohya" needs the lycoris-lora package: '
                   'pip install -e ".[lycoris]" (or pip install "lycoris-lora>=3.2,<4")')

SD_DOWN_UP_BLOCKS, SD_MID_BLOCKS = 12, 1  # networks/lora.py NUM_OF_BLOCKS / NUM_OF_MID_BLOCKS
SDXL_DOWN_UP_BLOCKS, SDXL_MID_BLOCKS = 9, 3  # SDXL_NUM_OF_BLOCKS / SDXL_NUM_OF_MID_BLOCKS

# Keys sd-scripts' modules read that this engine does not implement, with the reason given to the user.
NOT_IMPLEMENTED: dict[str, str] = {
    "split_qkv": "it writes a different key layout (separate q/k/v modules); not implemented here",
    "ggpo_beta": "GGPO gradient perturbation is not implemented here",
    "ggpo_sigma": "GGPO gradient perturbation is not implemented here",
    "img_attn_dim": "per-layer-type ranks for FLUX are not implemented here; use network_dim",
    "img_mlp_dim": "per-layer-type ranks for FLUX are not implemented here; use network_dim",
    "img_mod_dim": "per-layer-type ranks for FLUX are not implemented here; use network_dim",
    "txt_attn_dim": "per-layer-type ranks for FLUX are not implemented here; use network_dim",
    "txt_mlp_dim": "per-layer-type ranks for FLUX are not implemented here; use network_dim",
    "txt_mod_dim": "per-layer-type ranks for FLUX are not implemented here; use network_dim",
    "single_dim": "per-layer-type ranks for FLUX are not implemented here; use network_dim",
    "single_mod_dim": "per-layer-type ranks for FLUX are not implemented here; use network_dim",
    "in_dims": "LoRA on FLUX's input embedders (img_in, txt_in, ...) is not implemented here",
    "network_reg_dims": "per-module regular-expression ranks are not implemented here",
    "network_reg_lrs": "per-module regular-expression learning rates are not implemented here",
    "train_double_block_indices": "training selected block indices is not implemented here; "
                                  "train_blocks=double / single selects whole stacks",
    "train_single_block_indices": "training selected block indices is not implemented here; "
                                  "train_blocks=double / single selects whole stacks",
}
# Keys a module reads that mean nothing for the family this engine builds for it.
NO_EFFECT: dict[tuple[str, str], str] = {
    ("networks.lora_flux", "conv_dim"): "FLUX's LoRA targets have no convolutions, so conv_dim trains nothing",
    ("networks.lora_flux", "conv_alpha"): "FLUX's LoRA targets have no convolutions, so conv_alpha trains nothing",
}
MISTAKES: dict[str, str] = {
    "dropout": "neuron dropout is the network_dropout option (network_dropout = 0.1), not a network_args key",
}


@dataclass(frozen=True)
class NetworkArgs:
    """The typed ``network_args``; ``entries`` keeps them as given (``ss_network_args``)."""

    entries: dict[str, str] = field(default_factory=dict)
    conv_dim: int | None = None
    conv_alpha: float | None = None
    rank_dropout: float | None = None
    module_dropout: float | None = None
    train_t5xxl: bool = False  # FLUX: a LoRA on T5-XXL too (lora_te3_)
    train_blocks: str = "all"  # FLUX: all, single or double
    loraplus_lr_ratio: float | None = None
    loraplus_unet_lr_ratio: float | None = None
    loraplus_text_encoder_lr_ratio: float | None = None
    block_lr_weight: tuple[float, ...] | None = None  # one weight per UNet block
    block_dims: tuple[int, ...] | None = None  # one rank per UNet block (0: no module there)
    block_alphas: tuple[float, ...] | None = None
    conv_block_dims: tuple[int, ...] | None = None
    conv_block_alphas: tuple[float, ...] | None = None
    lycoris: dict[str, str] | None = None  # lycoris.kohya: its own keywords, as given

    @property
    def unet_plus_ratio(self) -> float | None:
        """LoRA+ ratio of the UNet's ``lora_up`` rate (sd-scripts: the specific ratio, else the common one)."""
        return self.loraplus_unet_lr_ratio or self.loraplus_lr_ratio

    @property
    def text_encoder_plus_ratio(self) -> float | None:
        return self.loraplus_text_encoder_lr_ratio or self.loraplus_lr_ratio


@cache
def read_module_keys() -> dict[str, frozenset[str]]:
    """Every network_args key each sd-scripts network module reads (data/kohya_network_args.tsv)."""
    keys: dict[str, set[str]] = {}
    with open(DATA_DIR / "kohya_network_args.tsv", newline="", encoding="utf-8") as handle:
        for row in csv.DictReader(handle, delimiter="\t"):
            keys.setdefault(row["network_module"], set()).add(row["key"])
    return {module: frozenset(names) for module, names in keys.items()}


def parse_network_args(entries: dict[str, str], network_module: str, *, sdxl: bool = False,
                       rank: tuple[int, float] = (4, 1.0), where: str = "network_args") -> NetworkArgs:
    """Check and type ``entries`` (``{"conv_dim": "4"}``) for ``network_module``; UserError on the first
    entry sd-scripts would not train as written. ``rank``: (network_dim, network_alpha), the block
    ranks' default."""
    if network_module == LYCORIS_MODULE:
        return _lycoris_args(entries, where)
    known = read_module_keys().get(network_module, frozenset())
    values: dict[str, Any] = {}
    for key, text in entries.items():
        _check_key(key, network_module, known, where)
        values[key] = _convert(key, text, where)
    return _resolve(dict(entries), values, sdxl, rank, where)


def _check_key(key: str, module: str, known: frozenset[str], where: str) -> None:
    if key in MISTAKES:
        raise UserError(f"{where}: {key!r}: {MISTAKES[key]}")
    if key not in known:
        near = difflib.get_close_matches(key, sorted(known), n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise UserError(f"{where}: {module} does not read {key!r} (sd-scripts would ignore it silently){hint}")
    if key in NOT_IMPLEMENTED:
        raise UserError(f"{where}: {key!r}: {NOT_IMPLEMENTED[key]}; remove it")
    if (module, key) in NO_EFFECT:
        raise UserError(f"{where}: {key!r}: {NO_EFFECT[(module, key)]}; remove it")


def _exact_bool(text: str) -> bool:
    """sd-scripts compares with the string "True"; any other spelling is False there."""
    if text not in ("True", "False"):
        raise ValueError(text)
    return text == "True"


def _choice(*allowed: str) -> Callable[[str], str]:
    def convert(text: str) -> str:
        if text not in allowed:
            raise ValueError(text)
        return text

    convert.__name__ = " or ".join(allowed)
    return convert


def _numbers(convert: type) -> Callable[[str], tuple[Any, ...]]:
    def parse(text: str) -> tuple[Any, ...]:
        return tuple(convert(part.strip()) for part in text.split(","))

    parse.__name__ = f"comma-separated list of {convert.__name__}s"
    return parse


def _weights(text: str) -> tuple[float, ...] | str:
    """A weight list ("1,0.5,,1": empty = 0 as in sd-scripts) or a preset ("cosine", "sine+0.5")."""
    if "," in text:
        return tuple(float(part) if part.strip() else 0.0 for part in text.split(","))
    name = text.split("+")[0]
    if name not in ("cosine", "sine", "linear", "reverse_linear", "zeros"):
        raise ValueError(text)
    if "+" in text:
        float(text.split("+", 1)[1])  # the added base weight must be a number
    return text


_exact_bool.__name__ = 'True or False (sd-scripts reads only the exact word "True")'
_weights.__name__ = "comma-separated list of weights or one of cosine, sine, linear, reverse_linear, zeros"

_TYPES: dict[str, Callable[[str], Any]] = {
    "conv_dim": int, "conv_alpha": float, "rank_dropout": float, "module_dropout": float,
    "train_t5xxl": _exact_bool, "verbose": _exact_bool, "train_blocks": _choice("all", "single", "double"),
    "loraplus_lr_ratio": float, "loraplus_unet_lr_ratio": float, "loraplus_text_encoder_lr_ratio": float,
    "down_lr_weight": _weights, "up_lr_weight": _weights, "mid_lr_weight": _numbers(float),
    "block_lr_zero_threshold": float, "block_dims": _numbers(int), "block_alphas": _numbers(float),
    "conv_block_dims": _numbers(int), "conv_block_alphas": _numbers(float),
}


# lycoris-lora reads these with int() / float() when the network is made: a bad one is said now, by name
_LYCORIS_NUMBERS: dict[str, Callable[[str], Any]] = {
    "conv_dim": int, "conv_alpha": float, "dropout": float, "rank_dropout": float, "module_dropout": float,
    "block_size": int, "factor": int, "constraint": float, "constrain": float, "loraplus_lr_ratio": float,
    "loraplus_unet_lr_ratio": float, "loraplus_text_encoder_lr_ratio": float,
}


def _convert(key: str, text: str, where: str) -> Any:
    return _convert_with(key, text, where, _TYPES[key])


def _convert_with(key: str, text: str, where: str, convert: Callable[[str], Any]) -> Any:
    try:
        value = convert(str(text).strip())
    except ValueError:
        raise UserError(f"{where}: {key}={text!r} is not a valid {convert.__name__}") from None
    numbers = value if isinstance(value, tuple) else (value,)
    if any(isinstance(n, float) and not math.isfinite(n) for n in numbers):
        raise UserError(f"{where}: {key}={text!r} must be a finite number")
    if key.endswith("dropout") and not 0.0 <= value < 1.0:
        raise UserError(f"{where}: {key}={text} must be in [0, 1)")
    if (key.endswith("_ratio") and value <= 0) or (key.endswith("dims") and min(numbers) < 0) or \
            (key == "conv_dim" and value < 0):
        raise UserError(f"{where}: {key}={text} must be positive")
    if key == "block_size" and value < 1:
        raise UserError(f"{where}: block_size={text}: DyLoRA trains the rank in blocks of at least 1")
    if key == "factor" and value != -1 and value < 1:
        raise UserError(f"{where}: factor={text}: LoKr's factor is a positive integer, or -1 for automatic")
    return value


def _resolve(entries: dict[str, str], values: dict[str, Any], sdxl: bool, rank: tuple[int, float],
             where: str) -> NetworkArgs:
    args = NetworkArgs(entries=entries, **{k: values[k] for k in (
        "conv_dim", "conv_alpha", "rank_dropout", "module_dropout", "train_t5xxl", "train_blocks",
        "loraplus_lr_ratio", "loraplus_unet_lr_ratio", "loraplus_text_encoder_lr_ratio") if k in values})
    if args.conv_dim == 0:  # sd-scripts: conv_dim 0 trains no 3x3 convolutions
        args = replace(args, conv_dim=None, conv_alpha=None)
    if args.conv_dim is not None and args.conv_alpha is None:
        args = replace(args, conv_alpha=1.0)  # sd-scripts' default
    lr_weight = block_lr_weight(values, sdxl, where)
    if lr_weight is None and "block_dims" not in values:
        for key in ("block_alphas", "conv_block_dims", "conv_block_alphas", "block_lr_zero_threshold"):
            if key in values:
                raise UserError(f"{where}: {key} takes effect only with block_dims or a *_lr_weight "
                                "(as in sd-scripts); add block_dims or remove it")
        return args
    dims, alphas, conv_dims, conv_alphas = _block_ranks(values, args, lr_weight, sdxl, rank, where)
    return replace(args, block_lr_weight=lr_weight, block_dims=dims, block_alphas=alphas, conv_block_dims=conv_dims,
                   conv_block_alphas=conv_alphas)


def block_count(sdxl: bool) -> int:
    """UNet blocks networks/lora.py numbers (SD 1/2: 25; SDXL: 23 with emb_layers and out)."""
    return SDXL_DOWN_UP_BLOCKS * 2 + SDXL_MID_BLOCKS + 2 if sdxl else SD_DOWN_UP_BLOCKS * 2 + SD_MID_BLOCKS


def block_lr_weight(values: dict[str, Any], sdxl: bool, where: str) -> tuple[float, ...] | None:
    """``get_block_lr_weight``: down + mid + up weights (SDXL: 1.0 added for emb_layers and out); a short
    list is filled with 1.0, a long one refused (sd-scripts cuts it with a warning), weights not above
    ``block_lr_zero_threshold`` are 0 (those blocks get no modules)."""
    if not {"down_lr_weight", "mid_lr_weight", "up_lr_weight"} & set(values):
        return None
    side, mid = (SDXL_DOWN_UP_BLOCKS, SDXL_MID_BLOCKS) if sdxl else (SD_DOWN_UP_BLOCKS, SD_MID_BLOCKS)
    threshold = values.get("block_lr_zero_threshold", 0.0)
    parts: list[float] = []
    for key, length in (("down_lr_weight", side), ("mid_lr_weight", mid), ("up_lr_weight", side)):
        weights = values.get(key)
        if weights is None:
            weights = (1.0,) * length
        elif isinstance(weights, str):
            weights = _preset(weights, length)
        if len(weights) > length:
            raise UserError(f"{where}: {key} has {len(weights)} values; this model has {length} such blocks")
        weights = tuple(weights) + (1.0,) * (length - len(weights))
        parts.extend(w if w > threshold else 0.0 for w in weights)
    return (1.0, *parts, 1.0) if sdxl else tuple(parts)


def _preset(text: str, length: int) -> tuple[float, ...]:
    name, _, base = text.partition("+")
    base_lr = float(base) if base else 0.0
    ramp = [i / (length - 1) for i in range(length)]
    shapes = {"cosine": [math.sin(math.pi * r / 2) for r in reversed(ramp)],
              "sine": [math.sin(math.pi * r / 2) for r in ramp],
              "linear": ramp, "reverse_linear": list(reversed(ramp)), "zeros": [0.0] * length}
    return tuple(w + base_lr for w in shapes[name])


def _block_ranks(values: dict[str, Any], args: NetworkArgs, lr_weight: tuple[float, ...] | None, sdxl: bool,
                 rank: tuple[int, float], where: str) -> tuple[tuple[Any, ...], tuple[Any, ...],
                                                               tuple[Any, ...] | None, tuple[Any, ...] | None]:
    """``get_block_dims_and_alphas`` + ``remove_block_dims_and_alphas``: a rank and alpha per block, from
    the lists given or else ``rank`` (network_dim, network_alpha) / conv_dim, conv_alpha; a block whose lr
    weight is 0 gets rank 0 (no module). Convolutions get modules only with conv_dim or conv_block_dims."""
    count = block_count(sdxl)
    given: dict[str, tuple[Any, ...] | None] = {}
    for key in ("block_dims", "block_alphas", "conv_block_dims", "conv_block_alphas"):
        value = given[key] = values.get(key)
        if value is not None and len(value) != count:
            raise UserError(f"{where}: {key} must have {count} values (one per UNet block, as sd-scripts counts "
                            f"them), got {len(value)}")
    if given["conv_block_dims"] is None and given["conv_block_alphas"] is not None:
        raise UserError(f"{where}: conv_block_alphas takes effect only with conv_block_dims; add it or remove this")
    dims = given["block_dims"] or (rank[0],) * count
    alphas = given["block_alphas"] or (float(rank[1]),) * count
    conv_dims, conv_alphas = given["conv_block_dims"], given["conv_block_alphas"]
    if conv_dims is None and args.conv_dim is not None:
        conv_dims, conv_alphas = (args.conv_dim,) * count, (args.conv_alpha,) * count
    elif conv_dims is not None and conv_alphas is None:
        conv_alphas = (args.conv_alpha if args.conv_alpha is not None else 1.0,) * count
    if lr_weight is not None:
        dims = tuple(0 if w == 0 else d for d, w in zip(dims, lr_weight))
        conv_dims = None if conv_dims is None else tuple(0 if w == 0 else d for d, w in zip(conv_dims, lr_weight))
    if not any(dims) and not any(conv_dims or ()):
        raise UserError(f"{where}: every block's rank is 0 (block_dims, conv_block_dims, the *_lr_weight), so nothing "
                        "would train; give at least one block a rank")
    return dims, alphas, conv_dims, conv_alphas


def check_lycoris_installed() -> None:
    """One line naming the extra when lycoris-lora is not installed (looked up without importing it)."""
    if importlib.util.find_spec("lycoris") is None:
        raise UserError(MISSING_LYCORIS)


def _lycoris_args(entries: dict[str, str], where: str) -> NetworkArgs:
    unknown = sorted(set(entries) - set(LYCORIS_KEYS))
    if unknown:
        near = difflib.get_close_matches(unknown[0], LYCORIS_KEYS, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise UserError(f"{where}: lycoris.kohya does not read {unknown[0]!r} (it would be ignored); {hint}its keys: "
                        f"{', '.join(LYCORIS_KEYS)}")
    for key, convert in _LYCORIS_NUMBERS.items():
        if key in entries:
            _convert_with(key, entries[key], where, convert)
    algo = entries.get("algo", "lora")
    if algo not in LYCORIS_ALGOS:
        near = difflib.get_close_matches(algo, LYCORIS_ALGOS, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise UserError(f"{where}: lycoris.kohya algo {algo!r} is unknown; {hint}use one of {', '.join(LYCORIS_ALGOS)}")
    check_lycoris_installed()
    return NetworkArgs(entries=dict(entries), lycoris=dict(entries))
