#!/usr/bin/env bash
# Train a tiny GPT with Megatron-LM's own training loop on CPU (gloo), with the WLB-LLM hooks.
#
#   [MEGATRON_LM=/path/to/Megatron-LM] TP=2 PP=4 CP=2 [VPP=1] [DP=1] scripts/train_cpu.sh [flags...]
#
# The layout comes from TP, CP, PP, VPP (virtual stages per pipeline rank) and DP; the number of
# processes is TP*CP*PP*DP. Flags after the script name go to Megatron (and our --wlb-* flags) after
# the tiny-GPT defaults (megatron_wlb/megatron/entry/cpu.py: TINY_GPT_ARGS), so they override them.
# With MEGATRON_LM, that checkout's pretrain_gpt.py runs (core_v0.16.1 or core_v0.19.0, patched:
# scripts/apply_patches.sh);
# without it, megatron_wlb.megatron.entry.launcher runs Megatron's pretrain() from the installed
# megatron-core (0.19 ships megatron/training). DATA (a PREFIX of PREFIX.bin/.idx) defaults to
# the Python standard library's text, written once under OUT (default out/train_cpu).
# Megatron's own iteration lines are printed as they come.
set -euo pipefail

die() { echo "train_cpu.sh: error: $*" >&2; exit 1; }
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python}
OUT=${OUT:-$repo/out/train_cpu}
nproc=$(( ${TP:-1} * ${CP:-1} * ${PP:-1} * ${DP:-1} )) || die "TP, CP, PP and DP must be positive integers"
[[ $nproc -ge 1 ]] || die "TP*CP*PP*DP must be >= 1"

DATA=${DATA:-$OUT/data/stdlib_text_document}
if [[ ! -f $DATA.idx ]]; then
    "$PYTHON" -m megatron_wlb.megatron.entry.cpu --write-corpus "$DATA"
fi
entry=()
if [[ -n ${MEGATRON_LM:-} ]]; then
    [[ -f $MEGATRON_LM/pretrain_gpt.py ]] || die "MEGATRON_LM=$MEGATRON_LM has no pretrain_gpt.py"
    grep -q "_wlb.apply(" "$MEGATRON_LM/pretrain_gpt.py" \
        || die "$MEGATRON_LM is not patched for WLB-LLM: run $repo/scripts/apply_patches.sh $MEGATRON_LM (checkouts at core_v0.16.1 or core_v0.19.0), or unset MEGATRON_LM to train through our launcher over the installed megatron-core 0.19 wheel"
    entry=(--pretrain-gpt "$MEGATRON_LM/pretrain_gpt.py")
fi
source "$repo/scripts/lib/job_python.sh"  # Megatron's dataset helpers built for $PYTHON, pyenv or not
use_job_python "$PYTHON" || die "cannot run PYTHON=$PYTHON"
exec "$PYTHON" -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node "$nproc" \
    -m megatron_wlb.megatron.entry.cpu "${entry[@]}" --tiny-gpt --data-path "$DATA" "$@"
