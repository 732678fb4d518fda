#!/usr/bin/env bash
# wan2.1-t2v-1.3b: cache latents, cache text-encoder outputs, train (musubi-tuner; written by autotune plan)
set -euo pipefail
PLAN_DIR="$(cd "$(dirname "$0")" && pwd)"
: "${MUSUBI_TUNER:?set MUSUBI_TUNER to your musubi-tuner checkout}"
: "${DIT:?set DIT to the model file}"
: "${T5:?set T5 to the model file}"
: "${VAE:?set VAE to the model file}"
cd "$PLAN_DIR"
export PYTHONPATH="$MUSUBI_TUNER/src${PYTHONPATH:+:$PYTHONPATH}"
python "$MUSUBI_TUNER"/src/musubi_tuner/wan_cache_latents.py --dataset_config dataset.toml --vae "$VAE" --batch_size 1
python "$MUSUBI_TUNER"/src/musubi_tuner/wan_cache_text_encoder_outputs.py --dataset_config dataset.toml --t5 "$T5" --batch_size 16
accelerate launch --num_cpu_threads_per_process 1 --mixed_precision bf16 "$MUSUBI_TUNER"/src/musubi_tuner/wan_train_network.py --config_file config.toml --dit "$DIT" --vae "$VAE" --task t2v-1.3B
