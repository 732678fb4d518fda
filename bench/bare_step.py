"""The floor for one training step: the model, its LoRA adapters, forward + backward + optimizer step, nothing else.

    python bench/bare_step.py --config_file CONFIG.toml        # the config bench/vs_sd_scripts.py writes

Reads the same config.toml both engines read (model file, resolution, rank, alpha, precision, steps,
max_grad_norm) and trains the same modules kohya's ``networks.lora`` targets on the UNet (every Linear and 1x1
conv inside the transformer blocks: 192 for SD1.5), each adapter ``base(x) + up(down(x)) * alpha / rank`` written
in the fewest plain torch calls. What the engines do around the step is left out: no dataset (one latent and one
text-encoder output, random, made once; ``train_batch_size`` of each, 1 unless the config says more), no text
encoder, no bookkeeping, no checks. Kept, because the result depends on it: noise and timesteps drawn each step,
DDPM's noising, the MSE loss, gradient clipping when the config asks for it, and torch's AdamW (fused, as our
engine builds it on this backend). Precision as both engines set it: ``mixed_precision = "bf16"`` runs the frozen
UNet in bf16 under autocast with fp32 adapters.

Run under ``bench/vs_sd_scripts.py``'s launcher (``--bare``), its optimizer steps are timed and profiled exactly
as the two engines' are. Hand-written because it is the measuring stick: a library's adapter would add its own work.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

# kohya's networks.lora UNet targets: Linear / 1x1 Conv2d modules inside Transformer2DModel blocks
TARGETS = re.compile(r".*attentions\.\d+\.(proj_in|proj_out|transformer_blocks\.\d+\.(attn[12]\.(to_q|to_k|to_v|"
                     r"to_out\.0)|ff\.net\.0\.proj|ff\.net\.2))$")


def add_adapters(unet, rank: int, alpha: float) -> list:
    """Rank-``rank`` adapters on every target, kohya's init (down Kaiming-uniform, up zero); their parameters."""
    import math

    import torch
    import torch.nn.functional as F

    params = []
    for name, module in unet.named_modules():
        if not TARGETS.match(name):
            continue
        conv = isinstance(module, torch.nn.Conv2d)
        out_features, in_features = module.weight.shape[:2]
        kernel = (1, 1) if conv else ()
        down = torch.nn.Parameter(torch.empty(rank, in_features, *kernel))
        torch.nn.init.kaiming_uniform_(down, a=math.sqrt(5))
        up = torch.nn.Parameter(torch.zeros(out_features, rank, *kernel))
        base, scale = module.forward, alpha / rank
        if conv:
            module.forward = lambda x, base=base, down=down, up=up, s=scale: base(x) + F.conv2d(F.conv2d(x, down),
                                                                                                up) * s
        else:
            module.forward = lambda x, base=base, down=down, up=up, s=scale: base(x) + F.linear(F.linear(x, down),
                                                                                                up) * s
        params += [down, up]
    return params


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config_file", required=True, help="the config.toml the engines read")
    parser.add_argument("--output_dir", help="accepted for the launcher's command line; nothing is written")
    args = parser.parse_args()
    import contextlib

    import toml
    import torch
    import torch.nn.functional as F
    from diffusers import DDPMScheduler

    from sd_scripts_compat.models.single_file import load_single_file
    from sd_scripts_compat.training.host_allocator import keep_freed_host_memory

    keep_freed_host_memory()  # as our engine does on the CPU: page faults are no part of the model's cost
    config = toml.loads(Path(args.config_file).read_text())
    dataset = toml.loads(Path(config["dataset_config"]).read_text())
    resolution = dataset["datasets"][0]["resolution"]  # kohya's forms: 256, [256, 256] or "256,256" (square here)
    resolution = int(str(resolution[0] if isinstance(resolution, list) else resolution).split(",")[0])
    bf16 = config.get("mixed_precision") == "bf16"
    torch.manual_seed(int(config.get("seed", 42)))
    bundle = load_single_file(config["pretrained_model_name_or_path"], dtype=torch.bfloat16 if bf16 else None)
    unet = bundle.unet.requires_grad_(False).train()
    rank = int(config["network_dim"])
    params = add_adapters(unet, rank, float(config.get("network_alpha") or rank))
    optimizer = torch.optim.AdamW(params, lr=float(config["learning_rate"]), fused=True)
    scheduler = DDPMScheduler.from_config(bundle.scheduler_config)
    batch = int(config.get("train_batch_size", 1))
    latents = torch.randn(batch, unet.config.in_channels, resolution // 8, resolution // 8)
    hidden = torch.randn(batch, 77, unet.config.cross_attention_dim)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    clip = float(config.get("max_grad_norm") or 0.0)
    for _ in range(int(config["max_train_steps"])):
        noise = torch.randn_like(latents)
        timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (batch,))
        with autocast:
            prediction = unet(scheduler.add_noise(latents, noise, timesteps), timesteps, hidden).sample
        F.mse_loss(prediction.float(), noise).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    print(f"bare loop: {len(params) // 2} adapters, {config['max_train_steps']} steps of batch {batch}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
