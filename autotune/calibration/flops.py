"""Counting a family's FLOPs on the meta device and fitting the per-sample polynomials the speed model ships.

Calibration only (``bench/calibrate_memory.py --flops-only`` writes the fits into
``autotune/data/memory_calibration.json``); planning reads the fits and never counts.
"""

from __future__ import annotations

from typing import Any


def count_flops(family: str, resolution: int, *, gradient_checkpointing: bool, rank: int = 16) -> dict[str, float]:
    """Count one batch-1 UNet forward and backward (LoRA-trained, frozen base) on the meta device."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from sd_scripts_compat.facts.families import get_family
    from sd_scripts_compat.models.build import build_modules
    from sd_scripts_compat.network.lora import create_network

    spec = get_family(family)
    bundle = build_modules(spec, device="meta", seed=None)
    network = create_network(bundle, network_dim=rank, network_alpha=rank, train_text_encoder=False)
    network.apply_to()
    unet = bundle.unet
    if gradient_checkpointing:
        unet.enable_gradient_checkpointing()
        unet.train()
    latent = resolution // spec.latent_downsample
    with torch.device("meta"):
        x = torch.empty(1, unet.config.in_channels, latent, latent)
        cond = torch.empty(1, 77, unet.config.cross_attention_dim)
        added = None
        if spec.is_sdxl:
            pooled = unet.config.projection_class_embeddings_input_dim - 6 * unet.config.addition_time_embed_dim
            added = {"text_embeds": torch.empty(1, pooled),
                     "time_ids": torch.empty(1, 6)}
        with FlopCounterMode(display=False) as forward:
            out = unet(x, torch.tensor([1]), cond, added_cond_kwargs=added).sample
        with FlopCounterMode(display=False) as backward:
            out.float().pow(2).mean().backward()
    return {"forward": float(forward.get_total_flops()), "backward": float(backward.get_total_flops())}


def count_encoder_flops(family: str, resolution: int) -> dict[str, float]:
    """Text encoders' forward and backward (trained) and the VAE encoder's forward, batch 1, on meta."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from sd_scripts_compat.facts.families import get_family
    from sd_scripts_compat.models.build import build_modules
    from sd_scripts_compat.network.lora import create_network

    spec = get_family(family)
    bundle = build_modules(spec, device="meta", seed=None)
    network = create_network(bundle, network_dim=16, network_alpha=16, train_unet=False, train_text_encoder=True)
    network.apply_to()
    te_forward = te_backward = 0.0
    with torch.device("meta"):
        for te, te_spec in zip(bundle.text_encoders, spec.text_encoders, strict=True):
            ids = torch.zeros(1, te_spec.tokenizer["model_max_length"], dtype=torch.long)
            with FlopCounterMode(display=False) as fwd:
                out = te(ids, output_hidden_states=True)
            with FlopCounterMode(display=False) as bwd:
                out.hidden_states[-2].float().pow(2).mean().backward()
            te_forward += fwd.get_total_flops()
            te_backward += bwd.get_total_flops()
        image = torch.empty(1, 3, resolution, resolution)
        with FlopCounterMode(display=False) as vae, torch.no_grad():
            bundle.vae.encode(image)
    return {"text_encoder_forward": float(te_forward), "text_encoder_backward": float(te_backward),
            "vae_encode": float(vae.get_total_flops())}


def fit_flops(family: str, resolutions: tuple[int, ...] | None = None) -> dict[str, Any]:
    """Per-sample FLOP fits in latent pixels for one family: ``f1*P + f2*P^2`` through two resolutions
    (half and full native size; the P-independent part -- time embedding, the cross-attention keys and
    values of the 77 tokens -- is negligible at full size). Given three or more resolutions a constant
    ``f0`` is fitted too: in the tiny families that part is a sizeable share of a step."""
    import numpy as np

    from sd_scripts_compat.facts.families import get_family

    spec = get_family(family)
    native = spec.resolution
    down = spec.latent_downsample
    resolutions = resolutions or (native // 2, native)
    pixels = np.array([(r // down) ** 2 for r in resolutions], dtype=float)
    columns = [pixels, pixels**2] if len(resolutions) < 3 else [np.ones_like(pixels), pixels, pixels**2]
    design = np.stack(columns, axis=1)
    series: dict[str, list[float]] = {"unet_forward": [], "unet_backward": [], "unet_backward_gc": []}
    for res in resolutions:
        plain = count_flops(family, res, gradient_checkpointing=False)
        gc = count_flops(family, res, gradient_checkpointing=True)
        series["unet_forward"].append(plain["forward"])
        series["unet_backward"].append(plain["backward"])
        series["unet_backward_gc"].append(gc["backward"])
    pad = [0.0] if len(resolutions) < 3 else []
    fits = {name: [*pad, *(float(c) for c in np.linalg.lstsq(design, np.array(v), rcond=None)[0])]
            for name, v in series.items()}
    encoders = count_encoder_flops(family, native)
    # the VAE encoder is convolutional but for one mid-block attention: linear in pixels is close
    fits["vae_encode"] = [0.0, encoders["vae_encode"] / (native // down) ** 2, 0.0]
    return {
        **fits,
        "latent_downsample": down,
        "text_encoder_forward": encoders["text_encoder_forward"],
        "text_encoder_backward_ratio": encoders["text_encoder_backward"] / encoders["text_encoder_forward"],
        "counted_at": list(resolutions),
        "counted": {name: values for name, values in series.items()},
    }
