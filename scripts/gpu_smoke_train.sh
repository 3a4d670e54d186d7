#!/usr/bin/env bash
# GPU smoke run (issue 5, item 5): a small GPT trained by Megatron-LM's own training loop
# (pretrain_gpt.py of the pinned commit, patched) with the WLB-LLM hooks on ONE GPU, for a few
# hundred steps on real text: the Python standard library's sources as byte-level tokens
# (EOD = 256, Megatron's NullTokenizer with --vocab-size 256). Everything it writes goes under OUT.
#
#   scripts/gpu_smoke_train.sh [OUT]          # default OUT = out/gpu_smoke (ignored by git)
#
# The Megatron-LM tree lives in the ignored folder megatron-lm/ beside this repo's code (or $MEGATRON_LM);
# a tree already there is used as it is (git not needed; scripts/apply_patches.sh identifies a copy
# without .git by content); only when there is none is it cloned from $MEGATRON_LM_URL (or a local mirror, $WLB_MEGATRON_MIRROR), checked
# out at patches/core_v0.16.1/PINNED_COMMIT and patched with scripts/apply_patches.sh; its code is never committed.
# Knobs: ITERS (300), SEQ (2048), SMAX (3072 = --wlb-max-seq-len), PACKING (wlb), CP_SHARDING
# (per-document), TRANSFORMER_IMPL (local; transformer_engine where TE is installed), MAX_BYTES.
# PREPARE_ONLY=1 stops after the tree and the data are ready (no GPU needed: the CPU tests use it).
# Pass/fail: the run must finish, log WLB metrics, and the last logged lm loss must be below the first.
# Written and syntax-checked; not run in the task that wrote it (no GPU there): no results are claimed.
set -euo pipefail

die() { echo "gpu_smoke_train.sh: error: $*" >&2; exit 1; }
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=$(mkdir -p "${1:-$repo/out/gpu_smoke}" && cd "${1:-$repo/out/gpu_smoke}" && pwd)
MLM=${MEGATRON_LM:-$repo/megatron-lm}
PINNED=$(tr -d '[:space:]' < "$repo/patches/core_v0.16.1/PINNED_COMMIT")
ITERS=${ITERS:-300}
SEQ=${SEQ:-2048}
SMAX=${SMAX:-3072}

# The training flags (PRINT_ARGS=1 prints them and exits: the CPU test parses them with Megatron's parser).
# 4 layers, hidden 256, GQA 8/4 heads, RoPE, SwiGLU; WLB packing and CP sharding hooks on.
DATA=$OUT/data/stdlib_text_document
SMOKE_ARGS=(
    --num-layers 4 --hidden-size 256 --num-attention-heads 8 --group-query-attention --num-query-groups 4
    --ffn-hidden-size 1024 --swiglu --normalization RMSNorm --position-embedding-type rope
    --disable-bias-linear --untie-embeddings-and-output-weights
    --attention-dropout 0.0 --hidden-dropout 0.0
    --seq-length "$SEQ" --max-position-embeddings "$SMAX" --micro-batch-size 1 --global-batch-size 8
    --train-iters "$ITERS" --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 30 --lr-decay-style cosine
    --weight-decay 0.1 --clip-grad 1.0 --bf16 --seed 1234 --calculate-per-token-loss
    --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-rope-fusion --no-persist-layer-norm
    --transformer-impl "${TRANSFORMER_IMPL:-local}"
    --tokenizer-type NullTokenizer --vocab-size 256
    --data-path "$DATA" --split 98,2,0
    --log-interval 10 --eval-interval 100 --eval-iters 5
    --save "$OUT/ckpt" --save-interval $(( ITERS / 2 )) --tensorboard-dir "$OUT/tensorboard"
    --wlb-packer "${PACKING:-wlb}" --wlb-cp-sharding "${CP_SHARDING:-per-document}"
    --wlb-max-seq-len "$SMAX" --wlb-log-interval 10
)
if [[ ${PRINT_ARGS:-0} != 0 ]]; then
    printf '%s\n' "${SMOKE_ARGS[@]}"
    exit 0
fi

[[ ${PREPARE_ONLY:-0} != 0 ]] || python - <<'EOF' || die "no CUDA GPU visible to torch"
import torch
assert torch.cuda.is_available()
print("gpu:", torch.cuda.get_device_name(0), "torch", torch.__version__)
EOF
python -c "import megatron_wlb" 2>/dev/null || die "megatron_wlb is not importable: pip install -e $repo"

# 1. The pinned Megatron-LM tree, patched. A tree already there (a git checkout, or a copy without .git
#    such as the staged kit's, already patched) is used as it is: no clone, no network, git not needed.
if [[ ! -f $MLM/pretrain_gpt.py ]]; then
    git --version >/dev/null 2>&1 || die "no Megatron-LM tree at $MLM and no git to clone one: set MEGATRON_LM to a
  copy of Megatron-LM $PINNED (scripts/gpu_stage.sh ships one, patched)"
    if [[ -n ${WLB_MEGATRON_MIRROR:-} ]]; then
        git clone -q --shared --no-checkout "$WLB_MEGATRON_MIRROR" "$MLM"
    else
        git clone -q --no-checkout "${MEGATRON_LM_URL:-https://github.com/NVIDIA/Megatron-LM.git}" "$MLM"
    fi
    git -C "$MLM" checkout -q --detach "$PINNED"
fi
"$repo/scripts/apply_patches.sh" "$MLM"

# 2. Real text: the standard library's .py files, one document per file, byte-level tokens.
if [[ ! -f $DATA.idx ]]; then
    mkdir -p "$OUT/data"
    DATA_PREFIX=$DATA MAX_BYTES=${MAX_BYTES:-60000000} python - <<'EOF'
import os
import sysconfig
from pathlib import Path

from megatron_wlb.data.reader import byte_documents, write_indexed_dataset

paths = sorted(str(p) for p in Path(sysconfig.get_paths()["stdlib"]).rglob("*.py") if "site-packages" not in p.parts)
docs = byte_documents(paths, separator=None, max_bytes=int(os.environ["MAX_BYTES"]))
write_indexed_dataset(os.environ["DATA_PREFIX"], docs)
print(f"wrote {os.environ['DATA_PREFIX']}.bin/.idx: {len(docs)} documents, {sum(len(d) for d in docs)} tokens")
EOF
fi

if [[ ${PREPARE_ONLY:-0} != 0 ]]; then
    echo "gpu_smoke_train.sh: prepared $MLM and $DATA (PREPARE_ONLY=1: not training)"
    exit 0
fi

# 3. Train through Megatron's own loop, one GPU.
export CUDA_DEVICE_MAX_CONNECTIONS=1
export PYTHONPATH=$MLM${PYTHONPATH:+:$PYTHONPATH}
LOG=$OUT/train.log
rm -rf "$OUT/ckpt"
torchrun --standalone --nnodes 1 --nproc-per-node 1 "$MLM/pretrain_gpt.py" "${SMOKE_ARGS[@]}" 2>&1 | tee "$LOG"

# 4. Verdict from the log.
python - "$LOG" <<'EOF'
import re
import sys

text = open(sys.argv[1], errors="replace").read()
losses = [float(m) for m in re.findall(r"lm loss: ([0-9.eE+-]+)", text)]
if len(losses) < 2:
    sys.exit(f"FAIL: fewer than two 'lm loss' entries in {sys.argv[1]}")
if "wlb" not in text.lower():
    sys.exit("FAIL: no WLB-LLM log lines (were the hooks applied?)")
print(f"first lm loss {losses[0]:.4f}, last {losses[-1]:.4f} over {len(losses)} log points")
sys.exit(0 if losses[-1] < losses[0] else "FAIL: the loss did not go down")
EOF
echo "gpu_smoke_train.sh: OK (log: $LOG)"
