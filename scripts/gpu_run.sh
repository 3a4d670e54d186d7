#!/usr/bin/env bash
# Every GPU measurement of megatron-wlb, from a kit staged by scripts/gpu_stage.sh, on a bare GPU machine
# (Python with torch and its triton; no network, git, compiler, pip or Megatron install needed).
#
#   KIT/run.sh [--part 1|2|3|all] [--out OUT] [--cpu-dry-run]
#
# Three parts, each under 10 minutes on one H100/H200 (run them as three calls where a call is capped):
#   1  environment (device, versions), kernel checks of every layout against the reference, forward and
#      backward, GQA included (scripts/gpu_kernel_check.py)
#   2  calibration (wlb calibrate: kernel efficiency table and cost profile), attention efficiency sweep
#      (scripts/gpu_profile_attention.py), per-layout CP latency (scripts/gpu_cp_latency.py --bwd)
#   3  Megatron-LM's own training loop (the kit's patched pretrain_gpt.py) on one GPU: a short run with
#      the --wlb-* flags and the same run without them (stock Megatron)
# Results: OUT (default KIT/results) gets one JSON per step, each naming the device as
# torch.cuda.get_device_name() reports it, and a log per step. --cpu-dry-run runs every step on the CPU
# with tiny shapes (tests/test_gpu_kit.py runs it in a venv holding only torch and numpy).
# Environment: PYTHON (python3), ITERS (training iterations of part 3; 40, dry run 2).
set -euo pipefail

die() { echo "gpu_run.sh: error: $*" >&2; exit 1; }
part=all dry=0 out=
while [[ $# -gt 0 ]]; do
    case $1 in
        --part) part=${2:?--part needs 1, 2, 3 or all}; shift 2 ;;
        --out) out=${2:?--out needs a folder}; shift 2 ;;
        --cpu-dry-run) dry=1; shift ;;
        -h|--help) sed -n '2,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument $1 (valid: --part 1|2|3|all, --out DIR, --cpu-dry-run)" ;;
    esac
done
[[ $part =~ ^(1|2|3|all)$ ]] || die "--part $part: give 1, 2, 3 or all"
script=$(readlink -f "${BASH_SOURCE[0]}")
wlb=$(cd "$(dirname "$script")/.." && pwd)
kit=$(cd "$wlb/.." && pwd)
mlm=$kit/megatron-lm
[[ -f $mlm/pretrain_gpt.py && -d $kit/wheels ]] || die "$kit is not a staged kit (no megatron-lm/ or wheels/): run scripts/gpu_stage.sh DIR"
OUT=${out:-$kit/results}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}

# The wheels, unpacked once into KIT/site (no pip needed); numpy only where the machine has none.
site=$kit/site
if [[ ! -f $site/.unpacked ]]; then
    mkdir -p "$site"
    for w in "$kit"/wheels/*.whl; do
        [[ $(basename "$w") == numpy-* ]] && "$PY" -c "import numpy" 2>/dev/null && continue
        "$PY" -m zipfile -e "$w" "$site"
    done
    touch "$site/.unpacked"
fi
export PYTHONPATH=$site:$wlb:$mlm${PYTHONPATH:+:$PYTHONPATH}
export CUDA_DEVICE_MAX_CONNECTIONS=1
if [[ $dry == 1 ]]; then
    export CUDA_VISIBLE_DEVICES=""
else
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
        || die "no CUDA GPU visible to torch (use --cpu-dry-run to check the kit on a CPU)"
fi

step() {  # step NAME COMMAND...: run, log to OUT/NAME.log, stop the part on failure
    local name=$1; shift
    echo "== $name: $*"
    local t0=$SECONDS
    if "$@" > "$OUT/$name.log" 2>&1; then
        echo "   ok in $(( SECONDS - t0 )) s (log $OUT/$name.log)"
    else
        tail -n 30 "$OUT/$name.log" >&2
        die "$name failed (log $OUT/$name.log)"
    fi
}

part1() {
    step env "$PY" - "$OUT/env.json" "$dry" <<'EOF'
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
    local smoke=(); [[ $dry == 1 ]] && smoke=(--smoke)
    step kernel_check "$PY" "$wlb/scripts/gpu_kernel_check.py" "${smoke[@]}" --out "$OUT/kernel_check.json"
}

part2() {
    if [[ $dry == 1 ]]; then
        step calibrate "$PY" -m megatron_wlb calibrate --smoke --out "$OUT/profile.json"
        step profile_attention "$PY" "$wlb/scripts/gpu_profile_attention.py" --smoke --out "$OUT/efficiency.json"
        step cp_latency "$PY" "$wlb/scripts/gpu_cp_latency.py" --smoke --out "$OUT/cp_latency"
    else
        step calibrate "$PY" -m megatron_wlb calibrate --config 7b_64k --device cuda --out "$OUT/profile.json"
        step profile_attention "$PY" "$wlb/scripts/gpu_profile_attention.py" --q-lens 128,512,2048,8192,32768 \
            --kv-lens 128,512,2048,8192,32768,131072 --max-seconds 150 --out "$OUT/efficiency.json"
        step cp_latency "$PY" "$wlb/scripts/gpu_cp_latency.py" --efficiency "$OUT/efficiency.json" --bwd \
            --heads 32 --kv-heads 8 --micro-batches 3 --cps 2,4,8 --max-seconds 200 --out "$OUT/cp_latency"
    fi
}

part3() {
    local corpus=$OUT/data/stdlib_text_document
    [[ -f $corpus.idx ]] || step corpus "$PY" -m megatron_wlb.megatron.cpu --write-corpus "$corpus"
    local iters=${ITERS:-40} entry
    local flags=(--wlb-packer wlb --wlb-cp-sharding per-document --wlb-max-seq-len 3072 --wlb-log-interval 1)
    if [[ $dry == 1 ]]; then
        iters=${ITERS:-2}
        entry=("$PY" -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node 1 -m megatron_wlb.megatron.cpu
               --pretrain-gpt "$mlm/pretrain_gpt.py" --tiny-gpt)
    else
        # the startup guards only (stock Megatron otherwise): no nvcc, no make on the GPU machine
        entry=("$PY" -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node 1
               -m megatron_wlb.megatron.startup "$mlm/pretrain_gpt.py"
               --num-layers 4 --hidden-size 256 --num-attention-heads 8 --group-query-attention
               --num-query-groups 4 --ffn-hidden-size 1024 --swiglu --normalization RMSNorm
               --position-embedding-type rope --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0
               --seq-length 2048 --max-position-embeddings 3072 --micro-batch-size 1 --global-batch-size 8
               --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --bf16 --seed 1234 --calculate-per-token-loss
               --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-rope-fusion
               --no-persist-layer-norm --transformer-impl local --tokenizer-type NullTokenizer --vocab-size 257
               --split 98,2,0 --log-interval 1 --eval-iters 0 --eval-interval 1000)
    fi
    local common=(--data-path "$corpus" --train-iters "$iters")
    step train_wlb "${entry[@]}" "${common[@]}" "${flags[@]}"
    step train_stock "${entry[@]}" "${common[@]}"
    step train_summary "$PY" - "$OUT" "$dry" <<'EOF'
import json, platform, re, sys
out, dry = sys.argv[1], sys.argv[2] == "1"
import torch
runs = {}
for name in ("train_wlb", "train_stock"):
    text = open(f"{out}/{name}.log", errors="replace").read()
    losses = [float(x) for x in re.findall(r"lm loss: ([0-9.eE+-]+)", text)]
    times = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", text)]
    if not losses:
        sys.exit(f"{name}: no 'lm loss' in its log")
    runs[name] = {"losses": losses, "ms_per_iteration": times, "wlb_lines": text.count("megatron_wlb")}
device = "CPU (dry run)" if dry else torch.cuda.get_device_name()
json.dump({"device": device, "runs": runs}, open(f"{out}/train.json", "w"), indent=1)
print(json.dumps({k: {"first": v["losses"][0], "last": v["losses"][-1]} for k, v in runs.items()}))
EOF
}

echo "gpu_run.sh: kit $kit, results $OUT$([[ $dry == 1 ]] && echo ' (CPU dry run)')"
[[ $part == 1 || $part == all ]] && part1
[[ $part == 2 || $part == all ]] && part2
[[ $part == 3 || $part == all ]] && part3
echo "gpu_run.sh: done (part $part); results in $OUT"
