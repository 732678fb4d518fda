#!/usr/bin/env bash
# flux2-dev: cache latents, cache text-encoder outputs, train (musubi-tuner; written by autotune plan)
set -euo pipefail
PLAN_DIR="$(cd "$(dirname "$0")" && pwd)"
: "${MUSUBI_TUNER:?set MUSUBI_TUNER to your musubi-tuner checkout}"
: "${DIT:?set DIT to the model file}"
: "${TEXT_ENCODER:?set TEXT_ENCODER to the model file}"
: "${VAE:?set VAE to the model file}"
cd "$PLAN_DIR"
export PYTHONPATH="$MUSUBI_TUNER/src${PYTHONPATH:+:$PYTHONPATH}"
python "$MUSUBI_TUNER"/src/musubi_tuner/flux_2_cache_latents.py --dataset_config dataset.toml --vae "$VAE" --batch_size 1 --model_version dev
python "$MUSUBI_TUNER"/src/musubi_tuner/flux_2_cache_text_encoder_outputs.py --dataset_config dataset.toml --text_encoder "$TEXT_ENCODER" --batch_size 16 --device cpu --model_version dev
accelerate launch --num_cpu_threads_per_process 1 --mixed_precision bf16 "$MUSUBI_TUNER"/src/musubi_tuner/flux_2_train_network.py --config_file config.toml --dit "$DIT" --vae "$VAE" --model_version dev
