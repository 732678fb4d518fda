"""lora-autotune: plan, run and recover LoRA training for Stable Diffusion on the GPU you have."""

__version__ = "0.1.0"
