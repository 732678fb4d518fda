"""SDXL LoRA training: ``python -m sd_scripts_compat.sdxl_train_network`` (sd-scripts' flags)."""

from sd_scripts_compat.train_network import main

if __name__ == "__main__":
    raise SystemExit(main(sdxl=True))
