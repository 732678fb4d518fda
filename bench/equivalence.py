"""Our engine against sd-scripts itself, step by step: loss, LoRA gradients and weights, the randomness forced equal.

Needs a local sd-scripts checkout and the Python that runs it (never committed; the script says so and stops when
they are absent):

    LORA_AUTOTUNE_SD_SCRIPTS=~/sd-scripts LORA_AUTOTUNE_SD_SCRIPTS_PYTHON=~/sd-scripts/venv/bin/python \\
        python bench/equivalence.py --cases sd15-lora,sd15-locon,sd15-loha,sdxl-lora-te --steps 5

Each case writes a random-weight full-size model file of the family (fp16, kohya's single-file layout), a one-image
dataset (so both engines see the same image each step, whatever their shuffling), one config.toml both engines read
unchanged, and one initial LoRA file both load with ``network_weights`` (random down and up weights, so that every
gradient is non-zero from the first step). Both run under the same launcher, whose seams are the only code that
differs from a user's run (each is a few lines below, in ``LAUNCHER``):

- the VAE posterior is its mean (diffusers' ``DiagonalGaussianDistribution`` built deterministic; sd-scripts' own
  FLUX.1 AE and SD3 VAE return their means), so the cached latents do not depend on either engine's random draws;
- the noise and timesteps of the k-th training draw come from one generator seeded with ``seed + k``: in sd-scripts
  through ``train_util.get_noise_noisy_latents_and_timesteps`` (its own code runs, with ``torch.randn_like`` and
  ``get_timesteps`` answering the forced values), in ours by ``runtimes.noise_prediction.sample_noise_and_timesteps``;
  for FLUX.1 and SD3 (flow matching) the k-th draw is the noise, then one normal and one uniform value per image,
  answered to ``torch.randn`` / ``randn_like`` / ``rand`` (and ``torch.normal``, diffusers' logit-normal density) inside
  one training step's forward on both sides (sd-scripts' ``process_batch``, our objectives' ``forward``), so each
  engine turns them into sigmas and timesteps its own way;
- the loss is read where it enters ``torch.autograd.backward``; the LoRA gradients (after clipping) and weights
  around every optimizer step through torch's global optimizer hooks, each parameter named by its initial value in
  the initial LoRA file.

The table gives, per case and step, the two losses and their difference, and the largest gradient and weight
difference over every LoRA tensor relative to the largest magnitude among them (0 = bit-identical; a tensor's own
magnitude would not do: at a small resolution the mid-block's self-attention sees one token, and its q / k gradients
are float noise around zero); then the metadata of the two LoRA files side by side: every ``ss_*`` and
``modelspec.*`` key either writes, equal or not, leaving out only times, session ids and the hashes of tensors that
differ. ``--record FILE`` writes sd-scripts' metadata per case (paths made relative, step saves included) for
``tests/test_sd_scripts_metadata.py``.

- ``--threads`` (default 1): with more, each engine's CPU reductions are split by thread and a run does not repeat
  its own gradients bit for bit.
- ``--unfused``: our AdamW is fused by default and sd-scripts' torch AdamW is not; this passes ``fused=False`` to
  both (weights then equal the bits where the gradients do).
- ``--probe WIDTHS``: the first input of the first Linear of each input width on both sides (where a difference
  enters: SDXL's 2816-wide vector, 320-wide time embedding, 2048-wide context).
- ``--sdxl-projection sd-scripts``: a seam that loads CLIP-G's ``text_projection`` in our engine as sd-scripts does
  (untransposed), to show that it is SDXL's one difference.
- ``--flux-clip-l sd-scripts``: FLUX.1's CLIP-L in our engine with sd-scripts' activation (gelu: its
  ``flux_utils.CLIPL_CONFIG`` names ``hidden_act`` twice and the second, gelu, wins; the model, diffusers and
  ComfyUI use quick_gelu).
- ``--posterior ours``: sd-scripts trains FLUX.1 / SD3 on the posterior mean our VAE computed for the image (the two
  VAE implementations differ in the last bits), so the training step alone is compared.
- ``--sd3-attn2 model``: a seam on sd-scripts' side: SD3.5 Medium's second (MMDiT-X) attention in the model's heads
  (its call passes ``num_heads`` where ``head_dim`` goes).
- FLUX.1 and SD3.5 run on files at full width with REDUCED's blocks and a one-layer T5-XXL, which both engines read
  at the file's depth (``models.file_depth``; a seam gives sd-scripts' fixed T5 config one layer).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS_ENV, PYTHON_ENV = "LORA_AUTOTUNE_SD_SCRIPTS", "LORA_AUTOTUNE_SD_SCRIPTS_PYTHON"
CAPTION = "a photo of sks dog"
COMMON = {"network_dim": 8, "network_alpha": 4, "optimizer_type": "AdamW", "learning_rate": 1e-3,
          "lr_scheduler": "constant", "cache_latents": True, "mixed_precision": "no", "save_precision": "float",
          "sdpa": True, "seed": 42, "max_data_loader_n_workers": 0, "save_model_as": "safetensors",
          "output_name": "lora", "caption_extension": ".txt", "max_grad_norm": 1.0, "enable_bucket": False}
# case -> (family, script, options beyond COMMON)
CASES: dict[str, tuple[str, str, dict]] = {
    "sd15-lora": ("sd15", "train_network", {"network_module": "networks.lora", "network_train_unet_only": True}),
    "sd15-locon": ("sd15", "train_network", {"network_module": "networks.lora", "network_train_unet_only": True,
                                             "network_args": ["conv_dim=4", "conv_alpha=2"]}),
    "sd15-loha": ("sd15", "train_network", {"network_module": "lycoris.kohya", "network_train_unet_only": True,
                                            "network_args": ["algo=loha", "conv_dim=4", "conv_alpha=2"]}),
    "sd15-options": ("sd15", "train_network", {  # options that enter the loss or the metadata, none of them random
        "network_module": "networks.lora", "network_train_unet_only": True, "enable_bucket": True,
        "min_bucket_reso": 64, "max_bucket_reso": 128, "bucket_reso_steps": 64, "min_snr_gamma": 5,
        "shuffle_caption": True, "keep_tokens": 1, "lr_scheduler": "cosine", "lr_warmup_steps": 1,
        "max_grad_norm": 0.5, "training_comment": "equivalence", "save_every_n_steps": 2}),
    "sdxl-lora": ("sdxl", "sdxl_train_network", {"network_module": "networks.lora", "network_train_unet_only": True}),
    "sdxl-lora-te": ("sdxl", "sdxl_train_network", {"network_module": "networks.lora", "text_encoder_lr": 5e-4}),
    "flux1-lora": ("flux-dev", "flux_train_network", {
        "network_module": "networks.lora_flux", "network_train_unet_only": True, "cache_text_encoder_outputs": True,
        "timestep_sampling": "shift", "discrete_flow_shift": 3.1582, "model_prediction_type": "raw",
        "guidance_scale": 1.0, "t5xxl_max_token_length": 16, "apply_t5_attn_mask": True}),
    "sd35-lora": ("sd3.5-medium", "sd3_train_network", {
        "network_module": "networks.lora_sd3", "network_train_unet_only": True, "cache_text_encoder_outputs": True,
        "training_shift": 3.0, "weighting_scheme": "uniform", "t5xxl_max_token_length": 16,
        "apply_lg_attn_mask": True, "apply_t5_attn_mask": True}),
}
CASES["sd35-large-lora"] = ("sd3.5-large", "sd3_train_network", CASES["sd35-lora"][2])
# the flow families with options that enter the loss, the network or the schedule
CASES["flux1-options"] = ("flux-dev", "flux_train_network", {
    **CASES["flux1-lora"][2], "timestep_sampling": "sigmoid", "sigmoid_scale": 1.5, "guidance_scale": 3.5,
    "model_prediction_type": "sigma_scaled", "discrete_flow_shift": 1.0, "network_args": ["train_blocks=single"],
    "max_grad_norm": 0.0, "lr_scheduler": "cosine_with_restarts", "lr_scheduler_num_cycles": 2, "lr_warmup_steps": 1})
CASES["sd35-options"] = ("sd3.5-large", "sd3_train_network", {
    **CASES["sd35-lora"][2], "weighting_scheme": "logit_normal", "logit_mean": 0.1, "logit_std": 1.2,
    "training_shift": 1.5, "apply_lg_attn_mask": False, "min_timestep": 50})
# The flow-matching families run on files at full width with fewer blocks and a one-layer T5-XXL: full FLUX.1 and
# SD3.5 do not fit this machine in fp32 beside sd-scripts' T5 (4.7 B parameters). Both engines read the block counts
# from the file (``models.file_depth``); sd-scripts' T5 config is fixed, so a seam gives it num_layers 1.
REDUCED = {"flux-dev": {"num_layers": 1, "num_single_layers": 1},
           "sd3.5-medium": {"num_layers": 2, "num_attention_heads": 2, "caption_projection_dim": 128,
                            "dual_attention_layers": [0]},
           "sd3.5-large": {"num_layers": 2, "num_attention_heads": 2, "caption_projection_dim": 128}}
T5_LAYERS = 1
FLOW_FAMILIES = ("flux-dev", "sd3.5-medium", "sd3.5-large")
IGNORED_METADATA = {"ss_training_started_at", "ss_training_finished_at", "ss_session_id", "modelspec.date",
                    "sshs_model_hash", "sshs_legacy_hash", "modelspec.implementation_version"}

LAUNCHER = r"""
import hashlib, json, os, runpy, sys
import torch
from safetensors.torch import load_file, save_file
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
out, side, seed = os.environ["EQ_OUT"], os.environ["EQ_SIDE"], int(os.environ["EQ_SEED"])
torch.set_num_threads(int(os.environ["EQ_THREADS"]))  # CPU kernels split reductions by thread: one thread repeats
def fingerprint(tensor):
    return tuple(tensor.shape), hashlib.sha1(tensor.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()
unnamed_keys = {}
for key, value in (load_file(os.environ["EQ_INIT"]) if os.path.isfile(os.environ["EQ_INIT"]) else {}).items():
    if not key.endswith(".alpha"):
        unnamed_keys.setdefault(fingerprint(value), []).append(key)
draws, losses, names, steps = [0], [], {}, [0]
def forced(latents):  # the k-th draw: noise and timesteps from one generator seeded seed + k
    generator = torch.Generator().manual_seed(seed + draws[0])
    draws[0] += 1
    noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32).to(latents.device, latents.dtype)
    return noise, torch.randint(0, 1000, (latents.shape[0],), generator=generator).long().to(latents.device)
from diffusers.models.autoencoders import vae as diffusers_vae  # seam: the VAE posterior is its mean
posterior_init = diffusers_vae.DiagonalGaussianDistribution.__init__
def mean_posterior(self, parameters, deterministic=False):
    posterior_init(self, parameters, deterministic=True)
    if not os.path.isfile(os.path.join(out, "posterior-0.safetensors")):  # the first image's mean, for --posterior
        save_file({"mean": self.mean.detach().float().cpu().contiguous()}, os.path.join(out, "posterior-0.safetensors"))
diffusers_vae.DiagonalGaussianDistribution.__init__ = mean_posterior
if side == "sd-scripts":  # seam: sd-scripts' own noising, its two random draws answered
    sys.path.insert(0, os.path.dirname(sys.argv[1]))
    from library import train_util
    noising, draw_timesteps = train_util.get_noise_noisy_latents_and_timesteps, train_util.get_timesteps
    randn_like = torch.randn_like
    def noised(args, noise_scheduler, latents):
        noise, timesteps = forced(latents)
        torch.randn_like, train_util.get_timesteps = (lambda *a, **k: noise), (lambda *a, **k: timesteps)
        try:
            return noising(args, noise_scheduler, latents)
        finally:
            torch.randn_like, train_util.get_timesteps = randn_like, draw_timesteps
    train_util.get_noise_noisy_latents_and_timesteps = noised
    if os.environ.get("EQ_FLOW"):  # seam: the FLUX AE's and the SD3 VAE's own posteriors are their means too
        from library import flux_models, sd3_models
        given = load_file(os.environ["EQ_POSTERIOR"]) if os.environ.get("EQ_POSTERIOR") else {}
        def posterior_mean(mean):  # --posterior ours: the mean our engine's VAE computed for this image
            ours = given.get("mean")
            return ours.to(mean.device, mean.dtype) if ours is not None and ours.shape == mean.shape else mean
        flux_models.DiagonalGaussian.forward = lambda self, z: posterior_mean(torch.chunk(z, 2, dim=self.chunk_dim)[0])
        sd3_models.SDVAE.encode = lambda self, image: posterior_mean(torch.chunk(self.encoder(image), 2, dim=1)[0])
    if os.environ.get("EQ_SD3_ATTN2") == "model":  # --sd3-attn2 model: MMDiT-X's second attention in heads of 64
        from library import sd3_models
        sd3_attention = sd3_models.attention
        def model_heads(q, k, v, *args, **kwargs):  # its one positional call passes num_heads where head_dim goes
            return sd3_attention(q, k, v, *((q.shape[-1] // args[0], *args[1:]) if args else ()), **kwargs)
        sd3_models.attention = model_heads
    if os.environ.get("EQ_T5_LAYERS"):  # seam: FLUX.1's T5-XXL config with fewer layers (its file holds that many)
        from library import flux_utils
        t5_config = flux_utils.T5Config
        flux_utils.T5Config = lambda **kw: t5_config(**{**kw, "num_layers": int(os.environ["EQ_T5_LAYERS"])})
else:
    from sd_scripts_compat.runtimes import noise_prediction
    noise_prediction.sample_noise_and_timesteps = lambda latents, settings, generator: forced(latents)
    if os.environ.get("EQ_SDXL_PROJECTION") == "sd-scripts":  # --sdxl-projection sd-scripts: CLIP-G's as it loads it
        from sd_scripts_compat.models import single_file
        convert_open_clip = single_file._convert_open_clip
        def untransposed(*args, **kwargs):
            state = convert_open_clip(*args, **kwargs)
            if "text_projection.weight" in state:
                state["text_projection.weight"] = state["text_projection.weight"].T.contiguous()
            return state
        single_file._convert_open_clip = untransposed
    if os.environ.get("EQ_FLUX_CLIP_L") == "sd-scripts":  # --flux-clip-l sd-scripts: gelu, as it builds CLIP-L
        from transformers.activations import ACT2FN
        from transformers.models.clip import modeling_clip
        mlp_init = modeling_clip.CLIPMLP.__init__
        def gelu_mlp(self, config):
            mlp_init(self, config)
            self.activation_fn = ACT2FN["gelu"]
        modeling_clip.CLIPMLP.__init__ = gelu_mlp
if os.environ.get("EQ_FLOW"):  # seam (FLUX.1, SD3): the step's noise, then its normal and uniform draws, forced
    torch_randn, torch_randn_like, torch_rand, torch_normal = torch.randn, torch.randn_like, torch.rand, torch.normal
    drawn = {}
    def size_of(args, kwargs):
        size = kwargs.get("size", args[0] if args else ())
        return (size, *[a for a in args[1:] if isinstance(a, int)]) if isinstance(size, int) else tuple(size)
    def new_draw(shape):  # the k-th draw: noise, then one normal and one uniform value per image
        generator = torch.Generator().manual_seed(seed + draws[0])
        draws[0] += 1
        drawn.update(noise=torch_randn(shape, generator=generator),
                     normal=torch_randn((shape[0],), generator=generator),
                     uniform=torch_rand((shape[0],), generator=generator))
        return drawn["noise"]
    def answer(kind, size, kwargs, original, args):
        if kind in drawn and size == tuple(drawn[kind].shape):
            return drawn.pop(kind).to(kwargs.get("device") or "cpu", kwargs.get("dtype") or torch.float32)
        return original(*args, **kwargs)
    def randn(*args, **kwargs):
        size = size_of(args, kwargs)
        if len(size) >= 4:
            return new_draw(size).to(kwargs.get("device") or "cpu", kwargs.get("dtype") or torch.float32)
        return answer("normal", size, kwargs, torch_randn, args)
    def randn_like(tensor, *args, **kwargs):
        if tensor.dim() >= 4:
            return new_draw(tuple(tensor.shape)).to(tensor.device, kwargs.get("dtype") or tensor.dtype)
        return torch_randn_like(tensor, *args, **kwargs)
    def rand(*args, **kwargs):
        return answer("uniform", size_of(args, kwargs), kwargs, torch_rand, args)
    def normal(mean, std=1.0, *args, **kwargs):  # diffusers' logit-normal density: mean + std * the normal draw
        size = tuple(kwargs.get("size", args[0] if args else ()))
        if not isinstance(mean, torch.Tensor) and "normal" in drawn and size == tuple(drawn["normal"].shape):
            return mean + std * drawn.pop("normal").to(kwargs.get("device") or "cpu")
        return torch_normal(mean, std, *args, **kwargs)
    def forcing(function):  # the draws are forced only inside one training step's forward
        def forced_step(*args, **kwargs):
            torch.randn, torch.randn_like, torch.rand, torch.normal = randn, randn_like, rand, normal
            try:
                return function(*args, **kwargs)
            finally:
                torch.randn, torch.randn_like, torch.rand, torch.normal = torch_randn, torch_randn_like, torch_rand, \
                    torch_normal
                drawn.clear()
        return forced_step
    if side == "sd-scripts":
        import train_network
        train_network.NetworkTrainer.process_batch = forcing(train_network.NetworkTrainer.process_batch)
    else:
        from sd_scripts_compat.runtimes import flow_matching, sd3_flow
        flow_matching.FlowMatchingObjective.forward = forcing(flow_matching.FlowMatchingObjective.forward)
        sd3_flow.Sd3FlowObjective.forward = forcing(sd3_flow.Sd3FlowObjective.forward)
autograd_backward = torch.autograd.backward
def backward(tensors, *args, **kwargs):
    if isinstance(tensors, torch.Tensor) and tensors.numel() == 1:
        losses.append(tensors.detach().float().item())
    return autograd_backward(tensors, *args, **kwargs)
torch.autograd.backward = backward
def lora_params(optimizer):
    return [p for group in optimizer.param_groups for p in group["params"]]
swapped = set()  # parameters held with their two output halves the other way round (SD3's last modulation, ours)
def halves_swapped(tensor):
    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)
def in_file_order(p, tensor):
    return (halves_swapped(tensor) if id(p) in swapped else tensor).detach().float().cpu().contiguous()
def before_step(optimizer, args, kwargs):
    if not names:  # the first step: each parameter still holds its initial value from the initial file
        for p in lora_params(optimizer):
            keys = unnamed_keys.get(fingerprint(p))
            if not keys and p.shape[0] % 2 == 0:
                keys = unnamed_keys.get(fingerprint(halves_swapped(p)))
                swapped.update({id(p)} if keys else set())
            names[id(p)] = keys.pop(0) if keys else f"?{len(names)}"
    save_file({names[id(p)]: in_file_order(p, p.grad) for p in lora_params(optimizer) if p.grad is not None},
              os.path.join(out, f"grad-{steps[0]}.safetensors"))
def after_step(optimizer, args, kwargs):
    save_file({names[id(p)]: in_file_order(p, p) for p in lora_params(optimizer)},
              os.path.join(out, f"weight-{steps[0]}.safetensors"))
    steps[0] += 1
register_optimizer_step_pre_hook(before_step)
text_outputs = {}
def text_encoder_output(module, args, output):  # each text encoder's first output (where a difference enters)
    name = type(module).__name__
    if name.startswith(("CLIPText", "T5Encoder")) and name not in text_outputs and isinstance(output[0], torch.Tensor):
        text_outputs[name] = output[0].detach().float().cpu().clone()
        save_file(text_outputs, os.path.join(out, "text-0.safetensors"))
torch.nn.modules.module.register_module_forward_hook(text_encoder_output)
probed, probe_widths = {}, {int(w) for w in os.environ.get("EQ_PROBE", "").split(",") if w}
def probe(module, args):  # --probe: the first input of the first Linear of each listed input width
    width = getattr(module, "in_features", None)
    if width in probe_widths and f"in{width}" not in probed and args and isinstance(args[0], torch.Tensor):
        probed[f"in{width}"] = args[0].detach().float().cpu().clone()
        save_file(probed, os.path.join(out, "probes-0.safetensors"))
if probe_widths:
    torch.nn.modules.module.register_module_forward_pre_hook(probe)
register_optimizer_step_post_hook(after_step)
def dump():
    with open(os.path.join(out, "losses.json"), "w") as f:
        json.dump({"losses": losses, "unnamed": sorted(n for n in names.values() if n.startswith("?")),
                   "never_trained": sorted(k for keys in unnamed_keys.values() for k in keys)}, f)
import atexit
atexit.register(dump)
target, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
if target.endswith(".py"):
    runpy.run_path(target, run_name="__main__")
else:
    runpy.run_module(target, run_name="__main__", alter_sys=True)
"""


def write_model(family_name: str, path: Path) -> Path:
    """A random-weight full-size model of the family as one fp16 single file (kept with ``--work``), written by a
    child process: a full SDXL is 10 GB in fp32 while it is built, which this process would keep from the runs."""
    if path.is_file():
        return path
    if family_name in REDUCED:
        return write_reduced_files(family_name, path)
    code = ("import sys, torch\n"
            "from sd_scripts_compat.facts.families import get_family\n"
            "from sd_scripts_compat.models.build import build_modules\n"
            "from sd_scripts_compat.models.single_file import save_single_file\n"
            "save_single_file(build_modules(get_family(sys.argv[1]), seed=0), sys.argv[2], dtype=torch.float16)\n")
    subprocess.run([sys.executable, "-c", code, family_name, str(path)], cwd=ROOT, check=True)
    return path


def bench_spec(family_name: str) -> Any:
    """The family as this script builds it: REDUCED's blocks and a T5-XXL of T5_LAYERS layers for the flow
    families (the spec both engines then read back from the files), else the family itself."""
    import dataclasses

    from sd_scripts_compat.facts.families import get_family

    spec = get_family(family_name)
    if family_name not in REDUCED:
        return spec
    encoders = tuple(dataclasses.replace(te, config={**te.config, "num_layers": T5_LAYERS})
                     if te.file_option == "t5xxl" else te for te in spec.text_encoders)
    return dataclasses.replace(spec, unet={**spec.unet, **REDUCED[family_name]}, text_encoders=encoders)


def write_reduced_files(family_name: str, folder: Path) -> Path:
    """A flow family's files as sd-scripts reads them, random weights (``bench_spec``: the transformer at full width,
    SD3 64 x depth, with REDUCED's blocks; CLIP and the VAE / AE at full size; T5-XXL at full width with one layer;
    fp16; a child process). FLUX.1: its four files; SD3.5: the MMDiT and VAE file, clip_l, clip_g and t5xxl beside
    it (sd-scripts reads no text encoder inside an SD3 file under ComfyUI's ``transformer.`` names)."""
    code = ("import sys, torch\n"
            "sys.path.insert(0, 'bench')\n"
            "from equivalence import bench_spec\n"
            "from sd_scripts_compat.models.build import build_modules\n"
            "from sd_scripts_compat.models.flux_files import save_flux_files\n"
            "from sd_scripts_compat.models.sd3_files import save_sd3_files\n"
            "bundle = build_modules(bench_spec(sys.argv[1]), seed=0)\n"
            "if sys.argv[1] == 'flux-dev':\n"
            "    save_flux_files(bundle, sys.argv[2], dtype=torch.float16)\n"
            "else:\n"
            "    save_sd3_files(bundle, sys.argv[2], text_encoders_inside=False, dtype=torch.float16)\n")
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-c", code, family_name, str(folder)], cwd=ROOT, check=True)
    return folder


def write_dataset(work: Path, resolution: int) -> Path:
    """One image at exactly the training size (no resize or crop on either side) and its caption."""
    from PIL import Image

    folder = work / "dataset" / "1_sks dog"
    folder.mkdir(parents=True, exist_ok=True)
    source = next(path for path in sorted((ROOT / "examples" / "dataset").rglob("*")) if path.suffix == ".png")
    with Image.open(source) as image:
        image.convert("RGB").resize((resolution, resolution), Image.Resampling.BICUBIC).save(folder / "img.png")
    (folder / "img.txt").write_text(CAPTION, encoding="utf-8")
    return folder.parent


def write_initial_lora(family_name: str, options: dict, path: Path) -> Path:
    """The LoRA both engines start from: our network's kohya keys for these options (tested against sd-scripts'
    recorded key lists), every tensor random (seeded), alphas as the network set them."""
    import torch

    from sd_scripts_compat.config.network_args import parse_network_args
    from sd_scripts_compat.models.build import build_modules
    from sd_scripts_compat.network.lora_file import save_lora_file

    bundle = build_modules(bench_spec(family_name), device="meta")
    entries = dict(arg.split("=", 1) for arg in options.get("network_args", []))
    args = parse_network_args(entries, options["network_module"], sdxl=family_name == "sdxl",
                              rank=(COMMON["network_dim"], COMMON["network_alpha"]))
    train_te = not options.get("network_train_unet_only", False)
    network: Any
    if options["network_module"] == "lycoris.kohya":
        from sd_scripts_compat.network.lycoris import create_lycoris_network

        network = create_lycoris_network(bundle, network_dim=COMMON["network_dim"], dropout=None,
                                         network_alpha=COMMON["network_alpha"], args=args,
                                         train_text_encoder=train_te, quiet=True)
        network.apply_to()
    else:
        from sd_scripts_compat.network.lora import create_network

        network = create_network(bundle, network_dim=COMMON["network_dim"], network_alpha=COMMON["network_alpha"],
                                 args=args, train_text_encoder=train_te)
    alphas = {module.lora_name: module.scale * module.lora_dim for module in network.modules()
              if hasattr(module, "lora_name") and hasattr(module, "scale")}
    generator = torch.Generator().manual_seed(7)
    state = {}
    for key, value in network.kohya_state_dict().items():
        if key.endswith(".alpha"):
            state[key] = value.clone() if value.device.type != "meta" else torch.tensor(alphas[key[:-6]])
        else:
            state[key] = torch.randn(tuple(value.shape), generator=generator) * 0.05
    save_lora_file(path, state, {})
    return path


def write_config(case: str, work: Path, steps: int, resolution: int, unfused: bool) -> Path:
    family_name, _, options = CASES[case]
    folder = work / case
    folder.mkdir(parents=True, exist_ok=True)
    values = {**COMMON, **options, "pretrained_model_name_or_path": str(work / f"{family_name}-random.safetensors"),
              "train_data_dir": str(work / "dataset"), "resolution": f"{resolution},{resolution}",
              "max_train_steps": steps, "network_weights": str(folder / "initial.safetensors")}
    files = work / f"{family_name}-random.safetensors"
    if family_name == "flux-dev":  # its four files
        values.update(pretrained_model_name_or_path=str(files / "flux1.safetensors"),
                      **{option: str(files / f"{option}.safetensors") for option in ("clip_l", "t5xxl", "ae")})
    elif family_name.startswith("sd3.5"):  # the model file, the text encoders beside it
        values.update(pretrained_model_name_or_path=str(files / f"{family_name}.safetensors"),
                      **{option: str(files / f"{option}.safetensors") for option in ("clip_l", "clip_g", "t5xxl")})
    if unfused:
        values["optimizer_args"] = ["fused=False"]
    config = folder / "config.toml"
    import toml

    config.write_text(toml.dumps(values), encoding="utf-8")
    return config


def run_side(side: str, case: str, work: Path, install: dict[str, str], tokenizers: Path, seed: int,
             threads: int, probe: str = "", seams: dict[str, str] | None = None) -> Path:
    """One engine's run of ``case`` under the launcher; its folder (LoRA, losses, per-step gradients and weights)."""
    family_name, script, _ = CASES[case]
    flow = family_name in FLOW_FAMILIES
    out = work / case / side
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    if side == "sd-scripts":
        command = [install["python"], "-c", LAUNCHER, str(Path(install["scripts"]) / f"{script}.py"),
                   "--tokenizer_cache_dir", str(tokenizers)]
        cwd = Path(install["scripts"])
    else:
        command, cwd = [sys.executable, "-c", LAUNCHER, f"sd_scripts_compat.{script}"], ROOT
        if flow:  # the T5 tokenizer sd-scripts finds in its cache
            command += ["--t5xxl_tokenizer", str(tokenizers / "google_t5-v1_1-xxl")]
    command += ["--config_file", str(work / case / "config.toml"), "--output_dir", str(out)]
    env = {**os.environ, "EQ_OUT": str(out), "EQ_SIDE": side, "EQ_SEED": str(seed), "HF_HUB_OFFLINE": "1",
           "EQ_THREADS": str(threads), "OMP_NUM_THREADS": str(threads), "EQ_PROBE": probe,
           **(seams or {}), "EQ_FLOW": "1" if flow else "",
           "EQ_T5_LAYERS": str(T5_LAYERS) if flow else "",
           "EQ_INIT": str(work / case / "initial.safetensors")}
    with open(out / "log.txt", "w", encoding="utf-8") as log:
        done = subprocess.run(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0 or not (out / "lora.safetensors").is_file():
        tail = (out / "log.txt").read_text(encoding="utf-8", errors="replace")[-3000:]
        raise SystemExit(f"{case}: {side} failed (exit {done.returncode}):\n{tail}")
    return out


def compare_steps(ours: Path, theirs: Path) -> list[dict]:
    """Per optimizer step: both losses, and the largest gradient and weight difference over the LoRA tensors both
    trained, relative to the largest magnitude among them (with how many tensors are bit-identical)."""
    from safetensors.torch import load_file

    our_run, their_run = (json.loads((side / "losses.json").read_text()) for side in (ours, theirs))
    rows = []
    for step, (our_loss, their_loss) in enumerate(zip(our_run["losses"], their_run["losses"])):
        row: dict[str, Any] = {"step": step + 1, "ours": our_loss, "sd-scripts": their_loss}
        for kind in ("grad", "weight"):
            a, b = (load_file(side / f"{kind}-{step}.safetensors") for side in (ours, theirs))
            shared = sorted(set(a) & set(b))
            scale = max((float(b[key].abs().max()) for key in shared), default=0.0)
            row[kind] = max((float((a[key] - b[key]).abs().max()) for key in shared), default=float("nan")) / (
                scale or 1.0)
            row[f"{kind}_identical"] = sum(bool((a[key] == b[key]).all()) for key in shared)
            row[f"{kind}_tensors"] = len(shared)
            row[f"{kind}_only"] = {"ours": sorted(set(a) - set(b)), "sd-scripts": sorted(set(b) - set(a))}
        rows.append(row)
    for name, run in (("ours", our_run), ("sd-scripts", their_run)):
        if run["unnamed"] or run["never_trained"]:
            print(f"  {name}: {len(run['unnamed'])} optimizer tensors not in the initial file, "
                  f"{len(run['never_trained'])} initial tensors never given to the optimizer "
                  f"{(run['unnamed'] + run['never_trained'])[:4]}", file=sys.stderr)
    return rows


def metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as file:
        return dict(file.metadata() or {})


def compare_metadata(ours: Path, theirs: Path) -> tuple[int, list[tuple[str, str | None, str | None]]]:
    """How many keys both files write equal, and every key that differs or only one writes (times, session ids and
    tensor hashes left out)."""
    a, b = metadata(ours / "lora.safetensors"), metadata(theirs / "lora.safetensors")
    keys = sorted((set(a) | set(b)) - IGNORED_METADATA)
    differing = [(key, a.get(key), b.get(key)) for key in keys if a.get(key) != b.get(key)]
    return len(keys) - len(differing), differing


def print_case(case: str, rows: list[dict], equal_keys: int, differing: list) -> None:
    print(f"\n### {case}\n")
    print("| step | loss ours | loss sd-scripts | loss difference | gradients: largest difference / largest gradient "
          "(bit-identical tensors) | weights after the step: the same (bit-identical) |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['step']} | {row['ours']:.9g} | {row['sd-scripts']:.9g} | {row['ours'] - row['sd-scripts']:.3g} "
              f"| {row['grad']:.3g} ({row['grad_identical']}/{row['grad_tensors']}) "
              f"| {row['weight']:.3g} ({row['weight_identical']}/{row['weight_tensors']}) |")
    for kind in ("grad", "weight"):
        only = rows[0][f"{kind}_only"] if rows else {}
        for side, keys in only.items():
            if keys:
                print(f"\n{len(keys)} {kind} tensors only {side} has, e.g. {keys[:3]}")
    print(f"\nMetadata: {equal_keys} keys equal", end="")
    print("; differing:" if differing else ", none differ (times, session ids and tensor hashes left out)")
    for key, ours, theirs in differing:
        print(f"- `{key}`: ours {shorten(ours)}, sd-scripts {shorten(theirs)}")


def print_probes(ours: Path, theirs: Path) -> None:
    from safetensors.torch import load_file

    if not all((side / "probes-0.safetensors").is_file() for side in (ours, theirs)):
        return
    a, b = (load_file(side / "probes-0.safetensors") for side in (ours, theirs))
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b or a[key].shape != b[key].shape:
            print(f"- probe {key}: ours {tuple(a[key].shape) if key in a else None}, "
                  f"sd-scripts {tuple(b[key].shape) if key in b else None}")
            continue
        difference = (a[key] - b[key]).abs()
        print(f"- probe {key}: largest difference {float(difference.max()):.3g} of {float(b[key].abs().max()):.3g}, "
              f"{int((difference > 0).sum())} of {difference.numel()} values differ")


def shorten(value: str | None, limit: int = 160) -> str:
    if value is None:
        return "(not written)"
    return repr(value if len(value) <= limit else value[:limit] + "...")


def record(cases: list[str], work: Path, destination: Path) -> None:
    """sd-scripts' metadata per case, the work folder's path replaced by ``<work>`` (the quick test's reference)."""
    import toml

    recorded = {}
    for case in cases:
        family_name, script, _ = CASES[case]
        folder = work / case / "sd-scripts"
        written = metadata(folder / "lora.safetensors")
        saves = {path.name: metadata(path) for path in sorted(folder.glob("lora-*.safetensors"))}  # step / epoch
        config = toml.loads((work / case / "config.toml").read_text(encoding="utf-8"))
        recorded[case] = {"family": family_name, "script": script, "sd_scripts_commit": sd_scripts_commit(),
                          "config": {key: value.replace(str(work), "<work>") if isinstance(value, str) else value
                                     for key, value in config.items()},
                          "metadata": {key: value.replace(str(work), "<work>") for key, value in written.items()},
                          "saves": {name: {key: value.replace(str(work), "<work>") for key, value in saved.items()}
                                    for name, saved in saves.items()}}
    destination.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def run_case(case: str, work: Path, install: dict[str, str], args: argparse.Namespace) -> None:
    """Both engines on one case and their table."""
    from autotune.recovery.sd_scripts import tokenizer_cache
    from sd_scripts_compat.facts.families import get_family
    from sd_scripts_compat.models.t5_tokenizer import TINY_T5_TOKENIZER_DIR

    family_name, _, options = CASES[case]
    family = get_family(family_name)
    write_model(family_name, work / f"{family_name}-random.safetensors")
    write_config(case, work, args.steps, args.resolution, args.unfused)
    pads = tuple(str(te.tokenizer.get("pad_token") or "<|endoftext|>") for te in family.text_encoders
                 if te.file_option != "t5xxl")
    if family_name in FLOW_FAMILIES:  # sd-scripts' CLIP-L and T5 hub names for FLUX.1 are SD3's first and third
        tokenizers = tokenizer_cache(work, "sd3", pads, t5=TINY_T5_TOKENIZER_DIR)
    else:
        tokenizers = tokenizer_cache(work, family.single_file_layout, pads)
    write_initial_lora(family_name, options, work / case / "initial.safetensors")
    ours = run_side("ours", case, work, install, tokenizers, args.seed, args.threads, args.probe,
                    {"EQ_SDXL_PROJECTION": args.sdxl_projection,
                     "EQ_FLUX_CLIP_L": args.flux_clip_l if family.flux_model_type else "file"})
    posterior = str(ours / "posterior-0.safetensors") if args.posterior == "ours" else ""
    theirs = run_side("sd-scripts", case, work, install, tokenizers, args.seed, args.threads, args.probe,
                      {"EQ_POSTERIOR": posterior, "EQ_SD3_ATTN2": args.sd3_attn2})
    print_case(case, compare_steps(ours, theirs), *compare_metadata(ours, theirs))
    print_probes(ours, theirs)


def sd_scripts_commit() -> str:
    """The checkout's commit where it is a git work tree (``LORA_AUTOTUNE_SD_SCRIPTS_COMMIT`` names it otherwise)."""
    named = os.environ.get("LORA_AUTOTUNE_SD_SCRIPTS_COMMIT")
    if named:
        return named
    done = subprocess.run(["git", "-C", os.environ.get(SCRIPTS_ENV, "."), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1234, help="the forced draws' first seed")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per run (default 1: with more, CPU reductions are split by thread and a "
                             "run does not repeat its own gradients bit for bit)")
    parser.add_argument("--probe", default="", metavar="WIDTHS",
                        help="compare the first input of the first Linear of each input width (e.g. 2816,320,2048: "
                             "SDXL's vector, time and context inputs): where a difference enters")
    parser.add_argument("--sdxl-projection", choices=("file", "sd-scripts"), default="file",
                        help="CLIP-G's text_projection in our engine: as the SDXL file means it (default; diffusers, "
                             "ComfyUI and SGM's x @ P) or as sd-scripts loads it (untransposed: x @ P.T)")
    parser.add_argument("--flux-clip-l", choices=("file", "sd-scripts"), default="file",
                        help="FLUX.1's CLIP-L in our engine: as the model is (default; quick_gelu: OpenAI's config, "
                             "diffusers, ComfyUI) or as sd-scripts builds it (gelu: its CLIPL_CONFIG names "
                             "hidden_act twice and the second wins)")
    parser.add_argument("--posterior", choices=("own", "ours"), default="own",
                        help="the VAE posterior mean sd-scripts trains on (FLUX.1, SD3): its own VAE's (default) or "
                             "the one our engine's computed for the same image (a seam: the two VAE implementations "
                             "differ in the last bits; with it, what is compared is the training step alone)")
    parser.add_argument("--sd3-attn2", choices=("sd-scripts", "model"), default="sd-scripts",
                        help="SD3.5 Medium's MMDiT-X second attention in sd-scripts: as it runs it (default: its call "
                             "passes num_heads where head_dim goes, so 64 heads of 24 where the model has 24 of 64) "
                             "or in the model's heads (a seam on sd-scripts' side: what ours computes)")
    parser.add_argument("--unfused", action="store_true", help="our AdamW unfused too (fused=False to both)")
    parser.add_argument("--work", help="keep the model files and runs here (default: a temporary folder)")
    parser.add_argument("--record", help="write sd-scripts' metadata per case to this JSON file")
    args = parser.parse_args()
    cases = [case.strip() for case in args.cases.split(",") if case.strip()]
    unknown = [case for case in cases if case not in CASES]
    if unknown:
        parser.error(f"unknown case {unknown[0]!r}; choose from {', '.join(CASES)}")
    scripts = os.environ.get(SCRIPTS_ENV)
    if not scripts:
        print(f"{SCRIPTS_ENV} is not set: point it at an sd-scripts checkout (and {PYTHON_ENV} at its Python); "
              "nothing was run", file=sys.stderr)
        return 0
    from autotune.recovery.sd_scripts import find_install

    found = find_install(Path(scripts).expanduser(), os.environ.get(PYTHON_ENV))
    install = {"scripts": str(found.scripts_dir), "python": str(found.python)}
    work = Path(args.work).expanduser().resolve() if args.work else Path(tempfile.mkdtemp(prefix="equivalence-"))
    write_dataset(work, args.resolution)
    print(f"{args.steps} steps at {args.resolution} px, fp32, batch 1, {'unfused' if args.unfused else 'our fused'} "
          f"AdamW, {args.threads} thread(s); work folder {work}", file=sys.stderr)
    for case in cases:
        run_case(case, work, install, args)
        sys.stdout.flush()
    if args.record:
        record(cases, work, Path(args.record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
