#!/usr/bin/env bash
# Is the balanced mode's loss curve stock Megatron's? Train both on your data, plot both curves, one verdict.
#
#   MEGATRON_LM=/path/to/Megatron-LM [NPROC_PER_NODE=8] [TORCHRUN_ARGS="--nnodes ..."] [OUT=out/compare_loss] \
#       scripts/compare_loss.sh <your Megatron flags> [--wlb-* flags of the balanced run]
#   MEGATRON_LM=... [TP=1 PP=2 CP=1 DP=1] scripts/compare_loss.sh --cpu [flags]   # the tiny GPT on CPU (gloo)
#
# Two runs of the checkout's pretrain_gpt.py (patched: scripts/apply_patches.sh; without a --wlb-* flag the
# patch does nothing, so the first run is stock Megatron): stock, with your flags only, then balanced, with
# `--wlb-packer wlb --wlb-pieces concat-and-cut --wlb-max-delay 0` and your --wlb-* flags after them (a later
# flag wins). Both also get `--log-interval 1 --calculate-per-token-loss --attention-dropout 0
# --hidden-dropout 0`: every iteration logged, and the same sums in another order (dropout would draw other
# masks for regrouped tokens). Your flags need per-document masking (`--reset-attention-mask
# --reset-position-ids`, or `--dataloader-inter-document-masking`). With --cpu, the tiny GPT's flags
# (megatron_wlb/megatron/entry/cpu.py) come first and DATA (a PREFIX of PREFIX.bin/.idx) defaults to the Python
# standard library's text with the tiny GPT's EOD, written once under OUT.
#
# Writes OUT/stock.log, OUT/balanced.log, OUT/loss_curves.png (both curves, and their relative difference) and
# OUT/loss_compare.json, and prints the verdict (`wlb compare-loss`): "equal" (every iteration's lm loss and
# grad norm within 1e-5 relative of stock's) or "differ" (from which iteration; the summed loss and the last
# 5 iterations' mean of each). At --wlb-max-delay 0 the exit status is 1 when they differ; at a larger
# delay the curves differ step by step by design and the status is 0 (docs/megatron.md, "The same loss curve").
set -euo pipefail

die() { echo "compare_loss.sh: error: $*" >&2; exit 2; }
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python}
OUT=${OUT:-$PWD/out/compare_loss}
cpu=0
if [[ ${1:-} == --cpu ]]; then cpu=1; shift; fi

[[ -n ${MEGATRON_LM:-} ]] || die "set MEGATRON_LM to a Megatron-LM checkout (core_v0.16.1 or core_v0.19.0) patched with scripts/apply_patches.sh: the stock run is its own pretrain_gpt.py"
script=$MEGATRON_LM/pretrain_gpt.py
[[ -f $script ]] || die "MEGATRON_LM=$MEGATRON_LM has no pretrain_gpt.py"
grep -q "_wlb.apply(" "$script" \
    || die "$MEGATRON_LM is not patched for WLB-LLM: run $repo/scripts/apply_patches.sh $MEGATRON_LM (the patch is inert without --wlb-* flags, so the stock run stays stock)"

# your flags: --wlb-* (with their values) go to the balanced run only; the rest to both
common=() wlb=() to=common
for arg in "$@"; do
    case $arg in
        --save|--save=*|--load|--load=*)
            die "$arg: both runs would share its checkpoints; drop it (the comparison trains both from scratch)" ;;
        --wlb-*) to=wlb; wlb+=("$arg") ;;
        --*) to=common; common+=("$arg") ;;
        *) if [[ $to == wlb ]]; then wlb+=("$arg"); else common+=("$arg"); fi ;;
    esac
done
forced=(--log-interval 1 --calculate-per-token-loss --attention-dropout 0.0 --hidden-dropout 0.0)
balanced=(--wlb-packer wlb --wlb-pieces concat-and-cut --wlb-max-delay 0 "${wlb[@]}")
delay=0
for ((i = 0; i < ${#balanced[@]}; i++)); do
    if [[ ${balanced[$i]} == --wlb-max-delay ]]; then delay=${balanced[$((i + 1))]:-}; fi
    if [[ ${balanced[$i]} == --wlb-max-delay=* ]]; then delay=${balanced[$i]#*=}; fi
done

mkdir -p "$OUT"
if [[ $cpu == 1 ]]; then
    nproc=$(( ${TP:-1} * ${CP:-1} * ${PP:-1} * ${DP:-1} )) || die "TP, CP, PP and DP must be positive integers"
    DATA=${DATA:-$OUT/data/stdlib_eod_text_document}
    if [[ ! -f $DATA.idx ]]; then
        "$PYTHON" -m megatron_wlb.megatron.entry.cpu --write-corpus "$DATA" --tiny-gpt-eod
    fi
    launch=("$PYTHON" -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node "$nproc"
            -m megatron_wlb.megatron.entry.cpu --pretrain-gpt "$script" --tiny-gpt --data-path "$DATA")
else
    launch=(torchrun --nproc-per-node "${NPROC_PER_NODE:-8}" ${TORCHRUN_ARGS:-} "$script")
fi
export PYTHONPATH="$MEGATRON_LM${PYTHONPATH:+:$PYTHONPATH}"
source "$repo/scripts/lib/job_python.sh"  # Megatron's dataset helpers built for $PYTHON, pyenv or not
use_job_python "$PYTHON" || die "cannot run PYTHON=$PYTHON"

echo "compare_loss.sh: stock Megatron (no --wlb-* flag) -> $OUT/stock.log"
env -u WLB_ENABLE "${launch[@]}" "${common[@]}" "${forced[@]}" > "$OUT/stock.log" 2>&1 \
    || die "the stock run failed; see $OUT/stock.log"
echo "compare_loss.sh: balanced (${balanced[*]}) -> $OUT/balanced.log"
"${launch[@]}" "${common[@]}" "${forced[@]}" "${balanced[@]}" > "$OUT/balanced.log" 2>&1 \
    || die "the balanced run failed; see $OUT/balanced.log"

require=()
[[ $delay == 0 ]] && require=(--require-equal)
exec "$PYTHON" -m megatron_wlb compare-loss --stock "$OUT/stock.log" --balanced "$OUT/balanced.log" \
    --plot "$OUT/loss_curves.png" --json "$OUT/loss_compare.json" --label "balanced, --wlb-max-delay $delay" \
    "${require[@]}"
