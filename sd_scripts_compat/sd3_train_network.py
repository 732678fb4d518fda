"""SD3 / SD3.5 LoRA training: ``python -m sd_scripts_compat.sd3_train_network`` (sd-scripts' flags)."""

from sd_scripts_compat.train_network import main

if __name__ == "__main__":
    raise SystemExit(main(script="sd3_train_network"))
