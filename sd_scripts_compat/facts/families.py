"""Model families (SD 1.x, SD 2.x, SDXL, FLUX.1, SD3.5, Chroma, Lumina 2, HunyuanImage-2.1, Anima and the
tiny test twins) as data.

Each family is one JSON file in ``data/families/``: diffusers-style configs for the denoiser (a UNet
or a transformer, named by its ``_class_name``; the JSON key stays ``unet`` for every family), the
VAE / AE and text encoder(s), the noise-scheduler config, and the few facts kohya needs (base model
version, modelspec architecture, LoRA key prefixes, whether it is a ``--v2`` model, which training
script trains it, the layout of its single-file checkpoints, the training objective). Code asks the
spec; it never branches on a family name. ``sd_scripts_compat.models.detect`` tells which family a
model is.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sd_scripts_compat.facts.errors import UserError

if TYPE_CHECKING:
    from sd_scripts_compat.facts.settings_space import ConfigKeys

FAMILY_DIR = Path(__file__).resolve().parents[1] / "data" / "families"
# further folders of family JSON files (os.pathsep-separated), read after ours: a family tried before it joins
# ``data/families`` (a name of ours cannot be replaced)
FAMILY_PATH_ENV = "SD_COMPAT_FAMILY_PATH"
CLIP_TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "data" / "clip_tokenizer"


@dataclass(frozen=True)
class TextEncoderSpec:
    config: dict[str, Any]
    tokenizer: dict[str, Any]  # pad_token, model_max_length
    lora_prefix: str  # "lora_te", "lora_te1", "lora_te2"
    hidden_state: str  # "last", "penultimate" (which layer conditions the UNet) or "pooled" (FLUX's CLIP-L)
    file_option: str | None = None  # the kohya option naming its own file when the base file lacks it (FLUX)
    lora_by_default: bool = True  # False: LoRA only on request (FLUX's T5-XXL: network_args train_t5xxl=True)
    lora_enable_arg: str | None = None  # the network_args key that requests it ("train_t5xxl")

    @property
    def class_name(self) -> str:
        return self.config["_class_name"]

    @property
    def tokenizer_kind(self) -> str:
        """"clip" (BPE vocabulary shipped with us) or "t5" (SentencePiece, read from the user's folder)."""
        return self.tokenizer.get("kind", "clip")

    @property
    def width(self) -> int:
        """Hidden size (transformers calls it ``hidden_size`` for CLIP, ``d_model`` for T5)."""
        return int(self.config.get("hidden_size", self.config.get("d_model", 0)))


@dataclass(frozen=True)
class TrainerFacts:
    """What the planner and the memory models need to know of the trainer of a family (``FamilySpec.trainer``);
    which adapter supervises it is the tuner's engine registry's business."""

    name: str
    # caches latents and text-encoder outputs with its own scripts before training: a training process holds no
    # VAE and no text encoders, and a plan is its dataset TOML, a --config_file and a script that caches, then trains
    caches_apart: bool
    # its block swap can stage through pinned host copies, and a two-expert model may offload the idle expert
    host_swap_options: bool
    fp8_scaled_weights: bool  # its fp8 base weights are scaled per tensor (musubi-tuner's --fp8_scaled)
    # its keys that split the LoRA's optimizer state across the processes (``ConfigKeys.state_split``); ()
    # where it has none; and whether it swaps blocks with the state split
    state_split: tuple[tuple[str, Any], ...] = ()
    swaps_with_split: bool = True


TRAINERS = {trainer.name: trainer for trainer in (
    # sd-scripts' one way to split anything across its processes is DeepSpeed; stage 2 splits the LoRA's optimizer
    # state and gradients (its LoRA equal to stage 0's, measured: tests/test_sd_scripts_deepspeed.py), stage 3 (the
    # frozen model sharded too) fails or hangs while loading, so only stage 2 is written; with DeepSpeed,
    # train_network.py skips prepare_unet_with_accelerator, where its block swap is set up, and DeepSpeed's engine
    # moves the whole model onto the card: no blocks are swapped beside it
    TrainerFacts("sd-scripts", caches_apart=False, host_swap_options=False, fp8_scaled_weights=False,
                 state_split=(("deepspeed", True), ("zero_stage", 2)), swaps_with_split=False),
    TrainerFacts("musubi-tuner", caches_apart=True, host_swap_options=True, fp8_scaled_weights=True))}


@dataclass(frozen=True)
class FamilySpec:
    name: str
    description: str
    tiny: bool
    ss_base_model_version: str
    modelspec_architecture: str
    resolution: int
    prediction_type: str
    v2: bool  # kohya's --v2: SD 2.x (OpenCLIP text encoder, 1024-wide cross-attention)
    kohya_script: str  # the sd-scripts entry point that trains it: train_network.py / sdxl_train_network.py
    single_file_layout: str  # text-encoder layout of its original-layout checkpoints: "sd1", "sd2", "sdxl"
    unet: dict[str, Any]
    vae: dict[str, Any]
    text_encoders: tuple[TextEncoderSpec, ...]
    unet_lora_names: str  # "diffusers" (SD1/2) or "sgm" (SDXL): how kohya names UNet LoRA modules
    scheduler: dict[str, Any]
    objective: str = "noise_prediction"  # "noise_prediction" (epsilon / v) or "flow_matching" (FLUX)
    modelspec_implementation: str | None = None  # modelspec.implementation when the family fixes it
    latent_patch_size: int = 1  # latent pixels packed into one transformer token along a side (FLUX: 2)
    t5xxl_max_token_length: int | None = None  # kohya's default for FLUX: dev 512, schnell 256
    flux_model_type: str | None = None  # kohya's --model_type value ("flux") for FLUX-family files
    builtin_meta_only: bool = False  # builtin:<name> only on the meta device (too large for random weights)
    network_module: str = "networks.lora"  # kohya's --network_module for this family (FLUX: networks.lora_flux)
    swap_resident_blocks: int = 0  # blocks of each swappable list that stay on the device (sd-scripts FLUX: 2)
    # a transformer's block lists in blocks_to_swap's order: the module list's name, and which Linears (name
    # prefixes inside a block) process image tokens and which text tokens (FLUX's double blocks: one stream each)
    transformer_block_groups: tuple[dict[str, Any], ...] = ()
    trained_here: bool = True  # our engine trains it; False: planned here, trained by the user's sd-scripts
    text_tokens: int | None = None  # text tokens the denoiser attends to (SD3: 77 CLIP + 256 T5); None: T5 length
    # kohya's LoRA names for a transformer whose names kohya's network module spells its own way
    # (unet_lora_names "table"): per block list, the kohya and diffusers block paths ("{i}": the index) and
    # each kohya Linear's diffusers parts (several: kohya's fused one, e.g. SD3's attn.qkv = to_q | to_k | to_v)
    lora_layout: tuple[dict[str, Any], ...] = ()
    # further diffusers modules kohya's DiT file holds beside the transformer (Anima's LLM adapter): counted
    # in the weights, run inside the step
    denoiser_extras: tuple[dict[str, Any], ...] = ()
    # kohya's option that stores the frozen transformer in fp8 for this family's script: "fp8_base", or
    # HunyuanImage's "fp8_scaled" (its script ignores fp8_base); None: the script forces fp8 off (Anima)
    fp8_option: str | None = "fp8_base"
    # module-path prefixes every single file of this family holds (after a ComfyUI "model.diffusion_model." or
    # Anima's "net." prefix), as kohya's model code names them: how a header tells SD3 / Lumina / HunyuanImage /
    # Anima files apart (with the first block list's count from ``lora_layout``)
    header_markers: tuple[str, ...] = ()
    # who trains a family our engine does not: "sd-scripts" (its ``kohya_script``) or "musubi-tuner" (kohya's
    # second trainer, for Qwen-Image, FLUX.2, Wan and Z-Image; ``musubi`` holds its script facts)
    trainer: str = "sd-scripts"
    # our engine's runtime for the family (``runtimes/<runtime>.py``, or a dotted module path): how it is loaded,
    # encoded, trained and sampled; None: our engine does not train it
    runtime: str | None = None
    # how ``blocks_to_swap`` splits over two block lists: "kohya" (sd-scripts' n // 2 double, (n - n // 2) * 2
    # single) or "musubi_flux2" (musubi's FLUX.2 ratio rule, ``Flux2.enable_block_swap``)
    swap_rule: str = "kohya"
    swap_count_keys: tuple[str, ...] = ("num_layers", "num_single_layers")  # denoiser config keys of the lists
    # musubi-tuner's facts for the family: the cache file's arch tag, its caching scripts, the options that pick
    # the model version, the text-encoder file option and its fp8 flag, fp8_scaled support, video or image
    musubi: dict[str, Any] | None = None

    @property
    def denoiser_class(self) -> str:
        """The denoiser's diffusers class: "UNet2DConditionModel" or "FluxTransformer2DModel"."""
        return self.unet["_class_name"]

    @property
    def is_transformer(self) -> bool:
        """True when the denoiser takes packed latent tokens instead of a latent image."""
        return not self.denoiser_class.startswith("UNet")

    @property
    def flow_matching(self) -> bool:
        return self.objective == "flow_matching"

    @property
    def bucket_step(self) -> int:
        """The smallest image-size step the model takes: VAE downsampling times latent patch packing
        (8 for SD, 16 for FLUX)."""
        return self.latent_downsample * self.latent_patch_size

    @property
    def is_sdxl(self) -> bool:
        return self.unet.get("addition_embed_type") == "text_time"

    @property
    def v_parameterization(self) -> bool:
        return self.prediction_type == "v_prediction"

    @property
    def latent_downsample(self) -> int:
        """Image pixels per latent pixel along a side: the VAE's own ratio where its config states one
        (HunyuanImage's 32, the Wan VAE's 8), else each encoder block but the last halves the image (diffusers
        derives it the same way). 8 for the SD / FLUX VAEs."""
        stated = self.vae.get("spatial_compression_ratio") or self.vae.get("scale_factor_spatial")
        return int(stated) if stated else 2 ** (len(self.vae["block_out_channels"]) - 1)

    @property
    def denoiser_text_tokens(self) -> int:
        """Text tokens in one sample of the denoiser's input (SD3: 77 CLIP + 256 T5; FLUX.1: its T5 length)."""
        return int(self.text_tokens or self.t5xxl_max_token_length or 512)

    def image_tokens(self, width: int, height: int | None = None) -> int:
        """Denoiser tokens of one image: packed latent tokens for a transformer (FLUX: (side / 16)^2), latent
        pixels for a UNet."""
        return (width // self.bucket_step) * ((height or width) // self.bucket_step)

    @property
    def temporal_stride(self) -> int:
        """Video frames per latent frame after the first (Wan's causal VAE: 4; clips are 1 + stride x k)."""
        return int(self.vae.get("scale_factor_temporal", 4))

    def latent_frames(self, frames: int) -> int:
        """Latent frames of a ``frames``-long clip: the first frame, then one per temporal stride; 1 for an image."""
        return 1 if frames <= 1 else 1 + (frames - 1) // self.temporal_stride

    # ---- blocks_to_swap: the one rule the engine, the memory model, the planner and the ladder share ----

    @property
    def swap_block_counts(self) -> tuple[int, int]:
        """(double-stream, single-stream) transformer blocks that ``blocks_to_swap`` counts; (0, 0): none. A
        transformer with one block list (SD3's joint blocks, Lumina's main layers, Anima's blocks) has no
        single-stream count."""
        if not self.is_transformer:
            return 0, 0
        counts = [int(self.unet.get(key, 0)) for key in self.swap_count_keys]
        return counts[0], (counts[1] if len(counts) > 1 else 0)

    @property
    def max_blocks_to_swap(self) -> int:
        """The most blocks this family swaps (FLUX.1: 35, as sd-scripts; 0: it cannot swap)."""
        if self.swap_rule == "musubi_flux2":
            return max_musubi_flux2_swap(*self.swap_block_counts)
        return max_blocks_to_swap(*self.swap_block_counts, resident=self.swap_resident_blocks)

    def swap_split(self, blocks_to_swap: int) -> tuple[int, int]:
        """(double, single) blocks swapped for ``blocks_to_swap``; more than the family allows is a UserError."""
        if self.swap_rule == "musubi_flux2":
            return musubi_flux2_split(blocks_to_swap, *self.swap_block_counts, model=self.name)
        return swap_split(blocks_to_swap, *self.swap_block_counts, resident=self.swap_resident_blocks,
                          model=self.name)

    def resolution_problem(self, width: int, height: int) -> str | None:
        """Why this family cannot train at ``width`` x ``height`` (None: it can): each side a multiple of the
        bucket step (8 px for SD, 16 for FLUX), from four steps (4 latent pixels or 2x2 tokens a side) to four
        times the native size. The engine checks a config with it; the planner checks a pinned ``--resolution``."""
        step, low, high = self.bucket_step, 4 * self.bucket_step, 4 * self.resolution
        if all(side % step == 0 and low <= side <= high for side in (width, height)):
            return None
        return (f"{self.name} trains at multiples of {step} px from {low} to {high} px (native {self.resolution}), "
                f"got {width},{height}")

    @property
    def script(self) -> str:
        """The entry point that trains it, without ``.py`` (``sdxl_train_network``): sd-scripts' and ours."""
        return self.kohya_script.removesuffix(".py")

    @property
    def trains_with(self) -> TrainerFacts:
        """The facts of the trainer that trains it where our engine does not (``trainer``)."""
        return TRAINERS[self.trainer]

    @property
    def config_keys(self) -> ConfigKeys:
        """The keys its configs name its fp8 weights and the split of the LoRA's optimizer state by: our engine's
        (``shard_optimizer_state``) where it trains the family, else its trainer's."""
        from sd_scripts_compat.facts.settings_space import ConfigKeys

        if self.trained_here:
            return ConfigKeys(fp8_option=self.fp8_option)
        trainer = self.trains_with
        return ConfigKeys(fp8_option=self.fp8_option, state_split=trainer.state_split,
                          swaps_with_split=trainer.swaps_with_split)

    @property
    def engine_module(self) -> str:
        """Our engine's module for ``kohya_script`` (``python -m sd_scripts_compat.sdxl_train_network``)."""
        return "sd_scripts_compat." + self.script


def swap_split(blocks_to_swap: int, num_double: int, num_single: int, *, resident: int = 0,
               model: str = "this model") -> tuple[int, int]:
    """(double, single) blocks swapped for kohya's ``blocks_to_swap``: n // 2 double and 2 * (n - n // 2) single
    blocks, the last of each list (``Flux.enable_block_swap``), keeping ``resident`` blocks of each list on the
    device (sd-scripts rotates swapped blocks through two of each: FLUX.1's limit of 35). A model with one list
    (``num_single`` 0: SD3, Lumina, Anima) swaps its last n blocks, ``(n, 0)``. Too many is one line."""
    if num_single == 0:
        double, single = blocks_to_swap, 0
    else:
        double, single = blocks_to_swap // 2, (blocks_to_swap - blocks_to_swap // 2) * 2
    if blocks_to_swap < 0 or double > num_double - resident or single > max(0, num_single - resident):
        most = max_blocks_to_swap(num_double, num_single, resident=resident)
        fix = f"swaps at most {most}; use 0-{most}" if most else "swaps none; remove blocks_to_swap"
        raise UserError(f"blocks_to_swap = {blocks_to_swap}: {model} ({num_double} double, {num_single} single "
                        f"blocks) {fix}")
    return double, single


def max_blocks_to_swap(num_double: int, num_single: int, *, resident: int = 0) -> int:
    """The largest ``blocks_to_swap`` that :func:`swap_split` accepts (0 for a model without blocks)."""
    if num_single == 0:
        return max(0, num_double - resident)
    n = 0
    while (n + 1) // 2 <= num_double - resident and ((n + 1) - (n + 1) // 2) * 2 <= num_single - resident:
        n += 1
    return n


def _flux2_raw_split(n: int, num_double: int, num_single: int) -> tuple[int, int]:
    """musubi-tuner's FLUX.2 split before its bounds check (``Flux2.enable_block_swap``): doubles by the
    single/double ratio, a double counting as two singles, moved to the other list while one runs short."""
    if n <= 0:
        return 0, 0
    ratio = num_single / num_double
    double = int(round(n / (1.0 + ratio / 2.0)))
    single = int(round(double * ratio))
    if num_double * 2 < num_single:
        while double >= 1 and double > num_double - 2:
            double, single = double - 1, single + 2
    else:
        while single >= 2 and single > num_single - 2:
            single, double = single - 2, double + 1
    if double == 0 and single == 0:
        return (0, 1) if num_single >= num_double else (1, 0)
    return double, single


def musubi_flux2_split(blocks_to_swap: int, num_double: int, num_single: int, *, model: str = "this model"
                       ) -> tuple[int, int]:
    """(double, single) blocks musubi-tuner swaps on FLUX.2 for ``blocks_to_swap``, keeping two of each list on
    the device (its assert); too many is one line."""
    double, single = _flux2_raw_split(blocks_to_swap, num_double, num_single)
    if blocks_to_swap < 0 or double > num_double - 2 or single > num_single - 2:
        most = max_musubi_flux2_swap(num_double, num_single)
        raise UserError(f"blocks_to_swap = {blocks_to_swap}: {model} ({num_double} double, {num_single} single "
                        f"blocks) swaps at most {most} in musubi-tuner; use 0-{most}")
    return double, single


def max_musubi_flux2_swap(num_double: int, num_single: int) -> int:
    """The largest ``blocks_to_swap`` musubi's FLUX.2 rule accepts (dev 29, klein 4B 13, klein 9B 16)."""
    n = 0
    while True:
        double, single = _flux2_raw_split(n + 1, num_double, num_single)
        if double > num_double - 2 or single > num_single - 2:
            return n
        n += 1


def family_files() -> dict[str, Path]:
    """Family name -> its JSON file: ours, then those of ``SD_COMPAT_FAMILY_PATH``'s folders."""
    files: dict[str, Path] = {}
    extra = [Path(folder) for folder in os.environ.get(FAMILY_PATH_ENV, "").split(os.pathsep) if folder]
    for folder in (FAMILY_DIR, *extra):
        for path in sorted(folder.glob("*.json")):
            files.setdefault(path.stem, path)
    return files


def family_names() -> list[str]:
    return sorted(family_files())


@cache
def get_family(name: str) -> FamilySpec:
    path = family_files().get(name)
    if path is None:
        raise KeyError(f"unknown model family {name!r}; known: {', '.join(family_names())}")
    try:
        return _family_from_json(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError, KeyError, AttributeError) as error:
        # ours are tested; a family file of SD_COMPAT_FAMILY_PATH is the user's: one line naming it
        raise UserError(f"{path}: not a family file this version reads ({type(error).__name__}: {error}); "
                        "compare it with one in sd_scripts_compat/data/families") from None


def _family_from_json(raw: dict[str, Any]) -> FamilySpec:
    raw["text_encoders"] = tuple(TextEncoderSpec(**te) for te in raw["text_encoders"])
    for key in ("transformer_block_groups", "lora_layout", "denoiser_extras", "header_markers"):
        raw[key] = tuple(raw.get(key, ()))
    if raw.get("trainer", "sd-scripts") not in TRAINERS:
        raise KeyError(f"trainer {raw['trainer']!r} is not one of {', '.join(TRAINERS)}")
    if "swap_count_keys" in raw:
        raw["swap_count_keys"] = tuple(raw["swap_count_keys"])
    return FamilySpec(**raw)


def model_config(config: dict[str, Any]) -> dict[str, Any]:
    """A diffusers/transformers config dict without the bookkeeping ``_class_name`` key."""
    return {k: v for k, v in config.items() if not k.startswith("_")}
