#!/usr/bin/env bash
# Every GPU measurement of megatron-wlb, from a kit staged by scripts/gpu_stage.sh, on a bare GPU machine
# (Python with torch and its triton; no network, git, compiler, pip or Megatron install needed).
#
#   KIT/run.sh [--all | --part 1|2|3] [--budget SECONDS] [--out OUT] [--cpu-dry-run]
#
# One call runs every part (--all, the default) within --budget seconds (540): give the caller's timeout 60 s
# more (600), which leaves a 15-minute lease (1-2 min to start) room for one short rerun on the warm machine.
#   1  environment (device, versions), kernel checks of every layout against the reference, forward and
#      backward, GQA included (scripts/gpu_kernel_check.py)
#   2  calibration (wlb calibrate: kernel efficiency table and cost profile), attention efficiency sweep
#      (scripts/gpu_profile_attention.py), per-layout CP latency (scripts/gpu_cp_latency.py --bwd)
#   3  Megatron-LM's own training loop (the kit's patched pretrain_gpt.py) on one GPU: a run with the --wlb-*
#      flags and the same run without them (stock Megatron), iterations sized to the part's share
# Each part gets a share of the time left (1: 20%, 2: 45%, 3: 35%; what a part leaves passes on), each sized
# step a share of its part's (megatron_wlb/kit.py). The scripts rewrite their JSON after every point, marked
# "partial" until done, and stop at their deadline with "stopped_at_deadline" (exit 0); calibrate and the
# training runs stop under `timeout` and their logs are summarised (calibrate.json, train.json); a step that
# fails stops its part, the next part still runs (exit status 1 at the end). --part N runs one part within
# the budget. Results: OUT (default KIT/results) gets one JSON per step, each naming the device as
# torch.cuda.get_device_name() reports it, a log per step, and budget.json: each part's and step's share,
# start, time used and whether it stopped at its deadline. --cpu-dry-run runs that same path on the CPU with
# tiny shapes (tests/test_gpu_kit.py runs it in a venv holding only torch and numpy).
# Environment: PYTHON (python3), ITERS (part 3's training iterations instead of those its share fits).
set -euo pipefail

die() { echo "gpu_run.sh: error: $*" >&2; exit 1; }
part=all dry=0 out= budget=540
while [[ $# -gt 0 ]]; do
    case $1 in
        --all) part=all; shift ;;
        --part) part=${2:?--part needs 1, 2, 3 or all}; shift 2 ;;
        --budget) budget=${2:?--budget needs seconds}; shift 2 ;;
        --out) out=${2:?--out needs a folder}; shift 2 ;;
        --cpu-dry-run) dry=1; shift ;;
        -h|--help) sed -n '2,24p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument $1 (valid: --all, --part 1|2|3, --budget SECONDS, --out DIR, --cpu-dry-run)" ;;
    esac
done
[[ $part =~ ^(1|2|3|all)$ ]] || die "--part $part: give 1, 2, 3 or all"
[[ $budget =~ ^[0-9]+$ ]] && (( budget > 0 )) || die "--budget $budget: give a whole number of seconds above 0 (default 540)"
parts=(1 2 3); [[ $part == all ]] || parts=("$part")
script=$(readlink -f "${BASH_SOURCE[0]}")
wlb=$(cd "$(dirname "$script")/.." && pwd)
kit=$(cd "$wlb/.." && pwd)
mlm=$kit/megatron-lm
[[ -f $mlm/pretrain_gpt.py && -d $kit/wheels ]] || die "$kit is not a staged kit (no megatron-lm/ or wheels/): run scripts/gpu_stage.sh DIR"
OUT=${out:-$kit/results}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
site=$kit/site
export PYTHONPATH=$site:$wlb:$mlm${PYTHONPATH:+:$PYTHONPATH}
export CUDA_DEVICE_MAX_CONNECTIONS=1
budget_py() { "$PY" -m megatron_wlb.kit "$@"; }  # the budget's arithmetic and records (standard library only)
budget_py start "$OUT" "$budget" "$(IFS=,; echo "${parts[*]}")" || die "cannot start the budget in $OUT"

# The wheels, unpacked once into KIT/site (no pip needed); numpy only where the machine has none.
if [[ ! -f $site/.unpacked ]]; then
    mkdir -p "$site"
    for w in "$kit"/wheels/*.whl; do
        [[ $(basename "$w") == numpy-* ]] && "$PY" -c "import numpy" 2>/dev/null && continue
        "$PY" -m zipfile -e "$w" "$site"
    done
    touch "$site/.unpacked"
fi
if [[ $dry == 1 ]]; then
    export CUDA_VISIBLE_DEVICES=""
else
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
        || die "no CUDA GPU visible to torch (use --cpu-dry-run to check the kit on a CPU)"
fi

step() {  # step PART NAME COMMAND...: run it within its share (a sized step: under `timeout`, its deadline in
          # WLB_KIT_DEADLINE; --foreground keeps it in this process group, so a caller's timeout stops it too),
          # log to OUT/NAME.log, record it in budget.json; status 1 only when it failed
    local part=$1 name=$2 plan limit deadline rc=0 status t0=$SECONDS
    shift 2
    plan=$(budget_py step "$OUT" "$part" "$name") || return 1
    read -r limit deadline <<< "$plan"
    if (( limit > 0 )); then
        echo "== $name (at most $limit s): $*"
        WLB_KIT_DEADLINE=$deadline timeout --foreground -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
    else
        echo "== $name: $*"
        "$@" > "$OUT/$name.log" 2>&1 || rc=$?
    fi
    status=$(budget_py done "$OUT" "$part" "$name" "$rc") || true
    case $status in
        ok) echo "   ok in $(( SECONDS - t0 )) s (log $OUT/$name.log)" ;;
        stopped) echo "   stopped at its deadline after $(( SECONDS - t0 )) s, what it measured kept (log $OUT/$name.log)" ;;
        *) tail -n 30 "$OUT/$name.log" >&2
           echo "gpu_run.sh: $name failed with exit status $rc (log $OUT/$name.log)" >&2
           return 1 ;;
    esac
}

part1() {
    step 1 env "$PY" - "$OUT/env.json" "$dry" <<'EOF' || return 1
import json, platform, sys
import torch
import megatron_wlb
from megatron_wlb.cp.attention import _aten_flash_ops, resolve_backend
cuda = torch.cuda.is_available()
device = torch.device("cuda" if cuda else "cpu")
info = {"device": torch.cuda.get_device_name() if cuda else f"CPU ({platform.processor() or 'cpu'}), dry run",
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "megatron_wlb": megatron_wlb.__version__,
        "backend": resolve_backend("auto", device, torch.bfloat16 if cuda else torch.float32),
        "aten_flash_ops": _aten_flash_ops() is not None}
try:
    from torch.nn.attention.varlen import varlen_attn
    from megatron_wlb.cp.attention import kernel_parameters
    info["varlen_attn_parameters"] = sorted(kernel_parameters(varlen_attn))
except ImportError:
    info["varlen_attn_parameters"] = None
from megatron.core import package_info
info["megatron_core"] = package_info.__version__
json.dump(info, open(sys.argv[1], "w"), indent=1)
print(json.dumps(info))
EOF
    local smoke=()
    [[ $dry == 1 ]] && smoke=(--smoke)
    step 1 kernel_check "$PY" "$wlb/scripts/gpu_kernel_check.py" "${smoke[@]}" --out "$OUT/kernel_check.json"
}

part2() {
    local calibrate profile cp_latency rc=0
    if [[ $dry == 1 ]]; then
        calibrate=(--smoke) profile=(--smoke) cp_latency=(--smoke)
    else
        local q_lens=128,512,2048,8192,32768 kv_lens=128,512,2048,8192,32768,131072
        calibrate=(--config 7b_64k --device cuda --q-lens "$q_lens" --kv-lens "$kv_lens")
        profile=(--q-lens "$q_lens" --kv-lens "$kv_lens")
        cp_latency=(--efficiency "$OUT/efficiency.json" --bwd --heads 32 --kv-heads 8 --micro-batches 3 --cps 2,4,8)
    fi
    rm -f "$OUT/profile.json" "$OUT/profile.efficiency.json"  # calibrate writes them at its end only
    step 2 calibrate "$PY" -m megatron_wlb calibrate "${calibrate[@]}" --out "$OUT/profile.json" || rc=1
    budget_py summarize-calibrate "$OUT" || return 1  # calibrate.json: what it logged; partial without profile.json
    (( rc == 0 )) || return 1
    step 2 profile_attention "$PY" "$wlb/scripts/gpu_profile_attention.py" "${profile[@]}" \
        --out "$OUT/efficiency.json" || return 1
    step 2 cp_latency "$PY" "$wlb/scripts/gpu_cp_latency.py" "${cp_latency[@]}" --out "$OUT/cp_latency"
}

part3() {
    local corpus=$OUT/data/stdlib_text_document iters entry dry_flag=()
    if [[ ! -f $corpus.idx ]]; then
        step 3 corpus "$PY" -m megatron_wlb.megatron.entry.cpu --write-corpus "$corpus" || return 1
    fi
    [[ $dry == 1 ]] && dry_flag=(--dry)
    if [[ -n ${ITERS:-} ]]; then
        iters=$ITERS
    else
        iters=$(budget_py iterations "$OUT" "${dry_flag[@]}") || return 1
    fi
    local flags=(--wlb-packer wlb --wlb-cp-sharding per-document --wlb-max-seq-len 3072 --wlb-log-interval 1)
    if [[ $dry == 1 ]]; then
        entry=("$PY" -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node 1 -m megatron_wlb.megatron.entry.cpu
               --pretrain-gpt "$mlm/pretrain_gpt.py" --tiny-gpt)
    else
        # the startup guards only (stock Megatron otherwise): no nvcc, no make on the GPU machine
        entry=("$PY" -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node 1
               -m megatron_wlb.megatron.hooks.startup "$mlm/pretrain_gpt.py"
               --num-layers 4 --hidden-size 256 --num-attention-heads 8 --group-query-attention
               --num-query-groups 4 --ffn-hidden-size 1024 --swiglu --normalization RMSNorm
               --position-embedding-type rope --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0
               --seq-length 2048 --max-position-embeddings 3072 --micro-batch-size 1 --global-batch-size 8
               --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --bf16 --seed 1234 --calculate-per-token-loss
               --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-rope-fusion
               --no-persist-layer-norm --transformer-impl local --tokenizer-type NullTokenizer --vocab-size 257
               --split 98,2,0 --log-interval 1 --eval-iters 0 --eval-interval 1000)
    fi
    echo "   $iters training iterations a run"
    local common=(--data-path "$corpus" --train-iters "$iters")
    step 3 train_wlb "${entry[@]}" "${common[@]}" "${flags[@]}" || return 1
    step 3 train_stock "${entry[@]}" "${common[@]}" || return 1
    step 3 train_summary "$PY" -m megatron_wlb.kit summarize-train "$OUT" "${dry_flag[@]}"
}

echo "gpu_run.sh: kit $kit, results $OUT, parts ${parts[*]} within $budget s$([[ $dry == 1 ]] && echo ' (CPU dry run)')"
failed=()
for p in "${parts[@]}"; do
    share=$(budget_py part "$OUT" "$p") || die "cannot begin part $p in $OUT/budget.json"
    echo "-- part $p: a share of $share s"
    "part$p" || failed+=("$p")
    budget_py end "$OUT" "$p"
done
echo "gpu_run.sh: done (parts ${parts[*]}) in $SECONDS s of $budget; results in $OUT, each part's time in $OUT/budget.json"
(( ${#failed[@]} == 0 )) || die "part(s) ${failed[*]} failed (the step that failed stopped its part)"
