"""Peak host RAM of a training run, by component, so a plan can say when the machine's RAM is the limit.

Analytic like the VRAM model (no torch import) and built on the same architecture facts
(``memory_calibration.json``). What the engine really does (``sd_scripts_compat.models``):

- **Loading** (the peak for most GPU plans): a file's tensors are read one at a time into buffers of their own
  and cast at once to the dtype their module trains in (``safetensors_file.read_tensors``): the UNet and text
  encoders in the weight dtype (fp32 on a CPU unless bf16), the VAE in fp32 on a CPU, else the weight dtype.
  Peak = the loaded modules (+ one tensor in flight): about the file's size when it is stored in the training
  dtype, whatever dtype the file has. A built-in random model is built in fp32 (4 B per element), nothing read.
- **After loading** the modules move to the GPU (their host copies are freed); the VAE, and the text encoders
  when their outputs are cached, are offloaded back to host RAM in the weight dtype. Cached latents / text
  outputs kept in RAM (``cache_latents`` without ``_to_disk``) are fp32 / weight-dtype host tensors.
- **DataLoader workers** are forked processes: their shared pages cost nothing until written, so each adds its
  private memory (``WORKER_PRIVATE_BYTES``) plus the batches it prefetches (2 per worker, torch's default),
  images decoded in fp32 when latents are not cached. On CUDA the main process pins the same batches again.
- **CPU plans** train on the host: the VRAM model's tensor peak lives in RAM beside the process.

Measured on this CPU (``bench/ram_calibrate.py``; peak RSS of a child process via ``getrusage``): the engine
process with torch, diffusers and transformers imported and a tiny model loaded: ``PROCESS_BYTES``; loading a
random fp16 SD1.5 single file (2.13 GB) into fp32 modules: 4.45 GiB peak (the file and fp32 modules at once,
6.40 GiB, before the loader cast as it read), into bf16: 2.42 GiB.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sd_scripts_compat.facts.families import FamilySpec

GIB = 2**30
PROCESS_BYTES = 520 * 2**20  # engine process, imports + tiny run: 495 MB peak RSS measured (rounded up)
WORKER_PRIVATE_BYTES = 64 * 2**20  # private pages of one forked worker: 13 MiB USS measured on a tiny run, padded
PREFETCH_FACTOR = 2  # torch DataLoader's default batches in flight per worker
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 2}  # modules offloaded to the host (fp8: upcast copies)
TEXT_TOKENS = 77


@dataclass(frozen=True)
class RamInputs:
    """What host RAM depends on. ``model_file_bytes``: the checkpoint's size on disk (None: a built-in model
    built in fp32); ``on_gpu``: modules leave the host after loading (False: a CPU plan, everything stays)."""

    family: str
    resolution: int
    batch_size: int
    num_images: int
    num_workers: int
    weight_dtype: str = "fp16"
    cache_latents: bool = True
    cache_latents_to_disk: bool = True
    cache_text_encoder_outputs: bool = False
    model_file_bytes: int | None = None
    on_gpu: bool = True
    training_tensor_bytes: int = 0  # CPU plans: the VRAM model's tensor peak, held in host RAM


@dataclass(frozen=True)
class RamEstimate:
    inputs: RamInputs
    components: dict[str, int] = field(default_factory=dict)  # loading phase and training phase parts
    loading_bytes: int = 0
    training_bytes: int = 0
    processes: int = 1  # training processes on this machine (one per GPU): each loads and holds its own
    turn_bytes: int = 0  # of loading_bytes, what leaves the host once a process has sharded, before the next loads

    @property
    def machine_loading_bytes(self) -> int:
        """Every process's loading at once; with ``turn_bytes`` (sharded runs load in turn,
        ``training.sharding.in_turn``) the last one's whole, the others' less what they sharded away."""
        return self.processes * self.loading_bytes - (self.processes - 1) * self.turn_bytes

    @property
    def loading_sets_peak(self) -> bool:
        """Whether the machine's peak is the model loading (else the training)."""
        return self.machine_loading_bytes >= self.processes * self.training_bytes

    @property
    def peak_bytes(self) -> int:
        """Every process's own + the larger of the two phases (loading ends before the workers start)."""
        return self.processes * self.components["process"] + max(self.machine_loading_bytes,
                                                                  self.processes * self.training_bytes)

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB


def model_file_bytes(model: str) -> int | None:
    """Bytes of a model on disk: a file's size, a diffusers folder's weight files; None for ``builtin:``."""
    if model.startswith("builtin:"):
        return None
    path = Path(model).expanduser()
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.suffix in (".safetensors", ".bin") and p.is_file())
    return None


def sharded_turn_bytes(family: FamilySpec, inputs: RamInputs, shard_ranks: int, offload: bool) -> int:
    """What one process's loading leaves in host RAM for the card once it has sharded the denoiser, before the next
    process loads: the denoiser as read (a DiT: bf16; a UNet: as ``predict_ram`` reads it), less the share each
    keeps on the host with ``offload`` (1 / ``shard_ranks``: the processes one copy is sharded across)."""
    from autotune.estimate.dit_memory import denoiser_loading_bytes, is_dit_family
    from autotune.estimate.memory_model import family_calibration

    if is_dit_family(family):
        whole = denoiser_loading_bytes(family)
    else:
        whole = _read_element_bytes(inputs) * _elements(family_calibration(family.name)["architecture"])[0]
    return whole - (whole // shard_ranks if offload else 0)


def _read_element_bytes(inputs: RamInputs) -> int:
    """Bytes per element the UNet and text encoders are read into: their training dtype from a file, fp32 for a
    built-in model (drawn in fp32, then cast)."""
    return DTYPE_BYTES.get(inputs.weight_dtype, 2) if inputs.model_file_bytes else 4


def _elements(arch: dict[str, Any]) -> tuple[int, int, int]:
    unet = arch["unet"]["float_elements"]
    te = sum(t["float_elements"] for t in arch["text_encoders"])
    return unet, te, arch["vae"]["float_elements"]


def _batch_bytes(inputs: RamInputs, down: int, latent_channels: int = 4) -> int:
    if inputs.cache_latents:
        return inputs.batch_size * latent_channels * (inputs.resolution // down) ** 2 * 4
    return inputs.batch_size * 3 * inputs.resolution**2 * 4  # decoded images, fp32 [-1, 1]


def predict_ram(inputs: RamInputs, calibration: dict[str, Any] | None = None) -> RamEstimate:
    """Peak host RAM of ``inputs`` by component (see the module docstring for what each one is)."""
    from autotune.estimate.memory_model import family_calibration, latent_downsample

    arch = family_calibration(inputs.family, calibration)["architecture"]
    unet, te, vae = _elements(arch)
    down = latent_downsample(arch)
    wbytes = DTYPE_BYTES.get(inputs.weight_dtype, 2)
    loaded = _read_element_bytes(inputs) * (unet + te)
    if inputs.model_file_bytes:  # read into the training dtypes (the VAE fp32 on a CPU or in an fp32 run)
        loaded += (4 if not inputs.on_gpu or wbytes == 4 else wbytes) * vae
    else:
        loaded += 4 * vae  # a built-in model is drawn in fp32, then cast
    offloaded = 0
    if inputs.on_gpu:
        offloaded = (4 if inputs.weight_dtype == "fp32" else wbytes) * vae
        if inputs.cache_text_encoder_outputs:
            offloaded += wbytes * te
    images = inputs.num_images
    latents_ram = 0
    if inputs.cache_latents and not inputs.cache_latents_to_disk:
        latents_ram = images * 4 * (inputs.resolution // down) ** 2 * 4
    text_ram = 0
    if inputs.cache_text_encoder_outputs:
        from sd_scripts_compat.facts.families import get_family

        width = sum(int(t.config["hidden_size"]) for t in get_family(inputs.family).text_encoders)
        text_ram = images * TEXT_TOKENS * width * wbytes
    batch = _batch_bytes(inputs, down)
    workers = inputs.num_workers * (WORKER_PRIVATE_BYTES + PREFETCH_FACTOR * batch)
    pinned = inputs.num_workers * PREFETCH_FACTOR * batch if inputs.on_gpu else 0
    components = {
        "process": PROCESS_BYTES,
        "loaded_modules": loaded,
        "offloaded_modules": offloaded,
        "cached_latents": latents_ram,
        "cached_text": text_ram,
        "dataloader_workers": workers,
        "pinned_batches": pinned,
        "training_tensors": 0 if inputs.on_gpu else inputs.training_tensor_bytes,
    }
    loading = components["loaded_modules"]
    training = offloaded + latents_ram + text_ram + workers + pinned + components["training_tensors"]
    return RamEstimate(inputs=inputs, components=components, loading_bytes=loading, training_bytes=training)


def describe(estimate: RamEstimate) -> str:
    """One line: the peak and what sets it."""
    phase = "model loading" if estimate.loading_sets_peak else "training"
    return f"predicted peak host RAM {estimate.peak_gib:.2f} GiB (set by {phase})"
