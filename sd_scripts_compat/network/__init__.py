"""The LoRA network and kohya's LoRA file format."""
