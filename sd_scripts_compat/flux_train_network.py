"""FLUX.1 LoRA training: ``python -m sd_scripts_compat.flux_train_network`` (sd-scripts' flags)."""

from sd_scripts_compat.train_network import main

if __name__ == "__main__":
    raise SystemExit(main(script="flux_train_network"))
