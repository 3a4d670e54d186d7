#!/usr/bin/env bash
# Launch a WLB-LLM Megatron-LM job on ONE node with torchrun (no SLURM).
#
#   MEGATRON_LM=/path/to/Megatron-LM DATA_PATH=/data/corpus_text_document [TOKENIZER_MODEL=<hf name|path>] \
#       scripts/launch_local.sh CONFIG [extra Megatron / --wlb-* flags...]
#
# CONFIG is a shipped config name (7b_64k, ...; configs/) or YAML path. The model and
# batch flags are the ones the SLURM scripts pass (scripts/slurm/make_sbatch.py --print-args); the 4D
# layout is scaled to this node: NPROC GPUs (default: all visible, from nvidia-smi or else torch),
# TP/CP/PP from the environment, or
# else the config's with the largest degree halved until TP*CP*PP divides NPROC, and
# DP = NPROC / (TP*CP*PP). When that layout is not the config's, the config's packing choices are
# passed as --wlb-* flags instead of --wlb-config (the start-up check accepts a config only on its
# own layout); tests/test_cli_launch.py runs that check on every shipped config.
# MEGATRON_LM must be the pinned commit, patched (scripts/apply_patches.sh).
# Tokenizer: TOKENIZER_MODEL (a HuggingFace tokenizer: needs transformers and the files) or, unset,
# Megatron's NullTokenizer over token ids as stored, with --vocab-size VOCAB_SIZE (default 32000).
# TRANSFORMER_IMPL: transformer_engine where it imports, else local (default: whichever is installed).
# Other knobs: TRAIN_ITERS, LR, MIN_LR, WARMUP_ITERS, SEED, SPLIT, CKPT_DIR, LOG_DIR,
# MASTER_PORT, PYTHON (the interpreter with megatron_wlb; default python);
# DRY_RUN=1 prints the command instead of running it.
set -euo pipefail

die() { echo "launch_local.sh: error: $*" >&2; exit 1; }
[[ $# -ge 1 ]] || die "usage: $0 CONFIG [extra flags...]   (CONFIG: a shipped config name or YAML path)"
config=$1; shift
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

: "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout at core_v0.16.1 patched with scripts/apply_patches.sh}"
: "${DATA_PATH:?set DATA_PATH to a Megatron indexed dataset prefix (PREFIX.bin/.idx), or a blend: W1 P1 W2 P2}"
PYTHON=${PYTHON:-python}
if [[ -z ${NPROC:-} ]]; then
    NPROC=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    [[ $NPROC -ge 1 ]] || NPROC=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
    [[ $NPROC -ge 1 ]] || die "no GPU visible (nvidia-smi -L, torch.cuda.device_count()); set NPROC"
fi
if [[ -n ${TOKENIZER_MODEL:-} ]]; then
    tokenizer_flags=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL")
else
    tokenizer_flags=(--tokenizer-type NullTokenizer --vocab-size "${VOCAB_SIZE:-32000}")
fi
if [[ -z ${TRANSFORMER_IMPL:-} ]]; then
    TRANSFORMER_IMPL=local
    "$PYTHON" -c 'import transformer_engine' >/dev/null 2>&1 && TRANSFORMER_IMPL=transformer_engine
fi
[[ -f $MEGATRON_LM/pretrain_gpt.py ]] || die "$MEGATRON_LM/pretrain_gpt.py not found"
grep -q "_wlb.apply(" "$MEGATRON_LM/pretrain_gpt.py" \
    || die "$MEGATRON_LM is not patched for WLB-LLM: run $here/apply_patches.sh $MEGATRON_LM"

layout_flags=(--nproc "$NPROC")
[[ -n ${TP:-} ]] && layout_flags+=(--tp "$TP")
[[ -n ${CP:-} ]] && layout_flags+=(--cp "$CP")
[[ -n ${PP:-} ]] && layout_flags+=(--pp "$PP")
flags_line=$("$PYTHON" "$here/slurm/make_sbatch.py" --print-args "$config" "${layout_flags[@]}") \
    || die "cannot derive the flags of $config (see above)"
read -r -a CONFIG_ARGS <<< "$flags_line"

name=$(basename "${config%.yaml}")
CKPT_DIR=${CKPT_DIR:-$PWD/checkpoints/$name-local}
LOG_DIR=${LOG_DIR:-$PWD/logs/$name-local}

export CUDA_DEVICE_MAX_CONNECTIONS=1          # TP/SP communication overlap needs in-order kernel queues
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export PYTHONPATH=$MEGATRON_LM${PYTHONPATH:+:$PYTHONPATH}
source "$here/lib/job_python.sh"  # torchrun, and Megatron's dataset helpers, of $PYTHON (pyenv or not)
use_job_python "$PYTHON" || die "cannot run PYTHON=$PYTHON"

cmd=(torchrun --standalone --nnodes 1 --nproc-per-node "$NPROC" --master-port "${MASTER_PORT:-29500}"
     "$MEGATRON_LM/pretrain_gpt.py" "${CONFIG_ARGS[@]}"
     --data-path $DATA_PATH --split "${SPLIT:-969,30,1}"
     "${tokenizer_flags[@]}"
     --train-iters "${TRAIN_ITERS:-1000}" --lr "${LR:-3e-4}" --min-lr "${MIN_LR:-3e-5}" --lr-decay-style cosine
     --lr-warmup-iters "${WARMUP_ITERS:-100}" --weight-decay 0.1 --clip-grad 1.0 --seed "${SEED:-1234}"
     --transformer-impl "$TRANSFORMER_IMPL" --calculate-per-token-loss
     $([[ $TRANSFORMER_IMPL == local ]] && echo --no-persist-layer-norm || true)
     --save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval "${SAVE_INTERVAL:-500}"
     --eval-interval "${EVAL_INTERVAL:-500}" --eval-iters "${EVAL_ITERS:-10}" --log-interval "${LOG_INTERVAL:-1}"
     --tensorboard-dir "$LOG_DIR/tensorboard"
     "$@")

if [[ ${DRY_RUN:-0} != 0 ]]; then
    printf '%q ' "${cmd[@]}"; echo
    exit 0
fi
mkdir -p "$CKPT_DIR" "$LOG_DIR"
exec "${cmd[@]}"
