#!/usr/bin/env python3
"""Generate one SLURM sbatch script per configs/*.yaml layout from a single template.

    python scripts/slurm/make_sbatch.py                 # (re)write scripts/slurm/<config>.sbatch
    python scripts/slurm/make_sbatch.py --check         # exit 1 if a committed script is out of date
    python scripts/slurm/make_sbatch.py my_run.yaml --out my_run.sbatch   # one script for your own config
    python scripts/slurm/make_sbatch.py --print-args 7b_64k [--nproc 8 [--tp 2 --cp 2 --pp 2]]  # the flags

Each script runs ``pretrain_gpt.py`` of a Megatron-LM checkout patched with scripts/apply_patches.sh
(``$MEGATRON_LM``: core_v0.16.1 or core_v0.19.0) or, without one, our launcher over the megatron-core 0.19
wheel, on SLURM_NNODES x GPUS_PER_NODE GPUs (``WLB_CPU=1``: through the CPU harness, a tiny GPT on gloo):
``srun`` starts one ``torchrun`` per node (c10d rendezvous at the first node), with the environment Megatron expects
(``CUDA_DEVICE_MAX_CONNECTIONS=1`` for TP/SP overlap) and the model, 4D layout and batch flags of the
config, plus ``--wlb-config <name>``. Data, tokenizer, checkpoints and training length come from the
environment (``DATA_PATH``, ``TOKENIZER_MODEL``, ``CKPT_DIR``, ``TRAIN_ITERS``, ...; ``EXTRA_ARGS`` is
appended last, so it can override anything). ``scripts/launch_local.sh`` uses ``--print-args`` so the
single-node launcher passes the same flags; with ``--nproc`` and no TP/CP/PP the layout is fitted to
the GPUs (``fit_to_node``), and a layout other than the config's gets the config's packing choices
as ``--wlb-*`` flags instead of ``--wlb-config`` (whose start-up check demands the config's layout).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from megatron_wlb.config import RunConfig, list_configs, load_config  # noqa: E402
from megatron_wlb.data.reader import DEFAULT_SPLIT  # noqa: E402

OUT_DIR = Path(__file__).resolve().parent
JOB_PYTHON = ROOT / "scripts" / "lib" / "job_python.sh"
GPUS_PER_NODE = 8


def model_args(run: RunConfig) -> list[str]:
    """Megatron flags for the config's model shape (Llama-style: RoPE, RMSNorm, no biases)."""
    m = run.model
    args = [
        f"--num-layers {m.num_layers}", f"--hidden-size {m.hidden}", f"--num-attention-heads {m.num_heads}",
        f"--ffn-hidden-size {m.ffn_hidden}", f"--seq-length {run.seq_len}",
        f"--max-position-embeddings {run.seq_len}", "--position-embedding-type rope",
        "--normalization RMSNorm", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
        "--attention-dropout 0.0", "--hidden-dropout 0.0",
    ]
    if m.num_kv_heads != m.num_heads:
        args += ["--group-query-attention", f"--num-query-groups {m.num_kv_heads}"]
    if m.swiglu:
        args.append("--swiglu")
    if m.kv_channels is not None:
        args.append(f"--kv-channels {m.kv_channels}")
    if m.is_moe:  # alltoall: the dispatcher that takes PP's variable-length micro-batches
        args += [f"--num-experts {m.num_experts}", f"--moe-router-topk {m.moe_topk}",
                 f"--moe-ffn-hidden-size {m.expert_ffn_hidden}", "--moe-token-dispatcher-type alltoall",
                 "--moe-router-load-balancing-type aux_loss", "--moe-aux-loss-coeff 1e-2"]
        if m.moe_shared_expert_hidden is not None:
            args.append(f"--moe-shared-expert-intermediate-size {m.moe_shared_expert_hidden}")
        if m.moe_layer_freq != 1:
            freq = m.moe_layer_freq
            args.append(f"--moe-layer-freq {freq}" if isinstance(freq, int) else
                        "--moe-layer-freq [" + ",".join(map(str, freq)) + "]")
        if m.moe_capacity_factor is not None:
            args.append(f"--moe-expert-capacity-factor {m.moe_capacity_factor}")
    return args


def parallel_args(run: RunConfig) -> list[str]:
    """4D layout and batch flags: micro-batch 1 (packed THD), global batch = N x DP micro-batches."""
    lay = run.layout
    args = [
        f"--tensor-model-parallel-size {lay.tp}", f"--context-parallel-size {lay.cp}",
        f"--pipeline-model-parallel-size {lay.pp}", "--micro-batch-size 1",
        f"--global-batch-size {run.micro_batches * lay.dp}", "--use-distributed-optimizer", "--bf16",
    ]
    if lay.tp > 1:
        args.append("--sequence-parallel")
    if lay.ep > 1:
        args.append(f"--expert-model-parallel-size {lay.ep}")
    if run.virtual_stages > 1:
        per_stage = run.model.num_layers // (lay.pp * run.virtual_stages)
        args.append(f"--num-layers-per-virtual-pipeline-stage {per_stage}")
    return args


def wlb_args(run: RunConfig, original: RunConfig | None = None, config_ref: str | None = None) -> list[str]:
    """``--wlb-config NAME`` (or ``config_ref``, e.g. the path of the user's YAML) when the run has the
    config's layout and seq_len (the start-up check demands that), else the config's packing choices as
    explicit ``--wlb-*`` flags."""
    if original is None or (original.layout, original.seq_len) == (run.layout, run.seq_len):
        return [f"--wlb-config {config_ref or run.name}"]
    from megatron_wlb.megatron.args.flags import config_flags

    flags = config_flags(run)
    return [f"{flag} {value}" for flag, value in zip(flags[::2], flags[1::2])]


def nodes_for(run: RunConfig, gpus_per_node: int = GPUS_PER_NODE) -> tuple[int, int]:
    """(nodes, GPUs per node) holding exactly the config's world size."""
    world = run.layout.world_size
    per_node = min(gpus_per_node, world)
    if world % per_node:
        raise ValueError(f"{run.name}: world size {world} is not a multiple of {per_node} GPUs per node")
    return world // per_node, per_node


def _bash_array(name: str, items: list[str]) -> str:
    return f"{name}=(\n" + "".join(f"    {item}\n" for item in items) + ")"


TEMPLATE = """#!/bin/bash
# GENERATED by scripts/slurm/make_sbatch.py from {source} -- edit the template, not this file.
# {model} model, {seq_len}-token sequences, TP={tp} CP={cp} PP={pp} DP={dp}: {world} GPUs = {nodes} node(s) x {gpn}.
#
# Submit from anywhere:  DATA_PATH=/data/corpus_text_document TOKENIZER_MODEL=/path/or/hf-name \\
#                        [MEGATRON_LM=/path/to/Megatron-LM] sbatch scripts/slurm/{name}.sbatch
# Ways in: with MEGATRON_LM, that checkout's own pretrain_gpt.py (core_v0.16.1 or core_v0.19.0, patched with
# scripts/apply_patches.sh); without it, our launcher over the installed megatron-core 0.19 wheel
# (python -m megatron_wlb.megatron.entry.launcher). See docs/megatron_launch.md.
# WLB_CPU=1: the same script in CPU mode, through the CPU harness (megatron_wlb.megatron.entry.cpu: a tiny GPT on
# gloo, Megatron's own loop, the config's packing choices; DP = nodes x WLB_CPU_NPROC_PER_NODE, default 1;
# DATA_PATH defaults to the standard library's text). Submit it with --gpus-per-node=0 where nodes have none.
#SBATCH --job-name=wlb-{name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={gpn}
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --output=wlb-{name}-%j.out
set -euo pipefail

WLB_NAME={name}
TP={tp}; CP={cp}; PP={pp}; DP={dp}
WORLD={world}
GPUS_PER_NODE=${{GPUS_PER_NODE:-{gpn}}}
WLB_CPU=${{WLB_CPU:-0}}
PYTHON=${{PYTHON:-python3}}

die() {{ echo "wlb-{name}.sbatch: error: $*" >&2; exit 1; }}
{job_python}
NNODES=${{SLURM_NNODES:?run this script with sbatch (SLURM_NNODES is unset)}}
if [[ $WLB_CPU == 0 ]]; then
    : "${{DATA_PATH:?set DATA_PATH to a Megatron indexed dataset prefix (PREFIX.bin/.idx), or a blend: W1 P1 W2 P2}}"
    : "${{TOKENIZER_MODEL:?set TOKENIZER_MODEL to a HuggingFace tokenizer name or path}}"
    (( NNODES * GPUS_PER_NODE == WORLD )) \\
        || die "TP*CP*PP*DP = $WORLD GPUs, but the job has $NNODES node(s) x $GPUS_PER_NODE GPUs"
fi
ENTRY=(-m megatron_wlb.megatron.entry.launcher)
if [[ -n ${{MEGATRON_LM:-}} ]]; then
    [[ -f $MEGATRON_LM/pretrain_gpt.py ]] || die "$MEGATRON_LM/pretrain_gpt.py not found"
    grep -q "_wlb.apply(" "$MEGATRON_LM/pretrain_gpt.py" \\
        || die "$MEGATRON_LM is not patched for WLB-LLM: run scripts/apply_patches.sh $MEGATRON_LM" \\
               "(core_v0.16.1 or core_v0.19.0), or unset MEGATRON_LM to run our launcher over the 0.19 wheel"
    ENTRY=("$MEGATRON_LM/pretrain_gpt.py")
    export PYTHONPATH=$MEGATRON_LM${{PYTHONPATH:+:$PYTHONPATH}}
fi
use_job_python "$PYTHON" || die "cannot run PYTHON=$PYTHON"  # torchrun and the helpers build: $PYTHON's

MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)  # sed reads all: no SIGPIPE
MASTER_PORT=${{MASTER_PORT:-$(( 20000 + ${{SLURM_JOB_ID:-0}} % 20000 ))}}
CKPT_DIR=${{CKPT_DIR:-$PWD/checkpoints/$WLB_NAME}}
LOG_DIR=${{LOG_DIR:-$PWD/logs/$WLB_NAME}}
mkdir -p "$CKPT_DIR" "$LOG_DIR"
read -r -a EXTRA <<< "${{EXTRA_ARGS:-}}"

# One torchrun per node, NPROC processes each, rendezvous on the first node: launch NPROC ARGS...
launch() {{
    local nproc=$1; shift
    srun --ntasks-per-node=1 --kill-on-bad-exit=1 \\
        torchrun --nnodes "$NNODES" --nproc-per-node "$nproc" \\
            --rdzv-id "${{SLURM_JOB_ID:-wlb}}" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" "$@"
}}

if [[ $WLB_CPU != 0 ]]; then
    # CPU mode: Megatron's loop on gloo through megatron_wlb.megatron.entry.cpu, the layout from TP/CP/PP/DP below
    export TP=1 CP=1 PP=1 DP=$(( NNODES * ${{WLB_CPU_NPROC_PER_NODE:-1}} ))
    if [[ -z ${{DATA_PATH:-}} ]]; then
        DATA_PATH=$LOG_DIR/data/stdlib_text_document
        [[ -f $DATA_PATH.idx ]] || "$PYTHON" -m megatron_wlb.megatron.entry.cpu --write-corpus "$DATA_PATH"
    fi
    CPU_ENTRY=()
    [[ -n ${{MEGATRON_LM:-}} ]] && CPU_ENTRY=(--pretrain-gpt "$MEGATRON_LM/pretrain_gpt.py")
{cpu_wlb_block}
    echo "wlb-{name} (CPU mode): $NNODES node(s) x ${{WLB_CPU_NPROC_PER_NODE:-1}} process(es), DP=$DP," \\
         "rendezvous $MASTER_ADDR:$MASTER_PORT"
    launch "${{WLB_CPU_NPROC_PER_NODE:-1}}" \\
        -m megatron_wlb.megatron.entry.cpu ${{CPU_ENTRY[@]+"${{CPU_ENTRY[@]}}"}} --tiny-gpt --data-path $DATA_PATH \\
        --train-iters ${{TRAIN_ITERS:-4}} "${{CPU_WLB_ARGS[@]}}" ${{EXTRA[@]+"${{EXTRA[@]}}"}}
    exit 0
fi

# The environment Megatron expects.
export CUDA_DEVICE_MAX_CONNECTIONS=1          # TP/SP communication overlap needs in-order kernel queues
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export NCCL_NVLS_ENABLE=${{NCCL_NVLS_ENABLE:-0}}
export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-8}}

{model_block}

{parallel_block}

DATA_ARGS=(
    --data-path $DATA_PATH
    --split ${{SPLIT:-{default_split}}}
    --tokenizer-type HuggingFaceTokenizer
    --tokenizer-model "$TOKENIZER_MODEL"
)

TRAIN_ARGS=(
    --train-iters ${{TRAIN_ITERS:-1000}}
    --lr ${{LR:-3e-4}}
    --min-lr ${{MIN_LR:-3e-5}}
    --lr-decay-style cosine
    --lr-warmup-iters ${{WARMUP_ITERS:-100}}
    --weight-decay 0.1
    --clip-grad 1.0
    --seed ${{SEED:-1234}}
    --transformer-impl ${{TRANSFORMER_IMPL:-transformer_engine}}
    --calculate-per-token-loss
    $([[ ${{TRANSFORMER_IMPL:-transformer_engine}} == local ]] && echo --no-persist-layer-norm || true)
    --save "$CKPT_DIR"
    --load "$CKPT_DIR"
    --save-interval ${{SAVE_INTERVAL:-500}}
    --eval-interval ${{EVAL_INTERVAL:-500}}
    --eval-iters ${{EVAL_ITERS:-10}}
    --log-interval ${{LOG_INTERVAL:-1}}
    --tensorboard-dir "$LOG_DIR/tensorboard"
)

{wlb_block}

echo "wlb-{name}: $NNODES node(s) x $GPUS_PER_NODE GPUs, TP=$TP CP=$CP PP=$PP DP=$DP," \\
     "rendezvous $MASTER_ADDR:$MASTER_PORT"
launch "$GPUS_PER_NODE" "${{ENTRY[@]}}" \\
    "${{MODEL_ARGS[@]}}" "${{PARALLEL_ARGS[@]}}" "${{DATA_ARGS[@]}}" "${{TRAIN_ARGS[@]}}" "${{WLB_ARGS[@]}}" \\
    ${{EXTRA[@]+"${{EXTRA[@]}}"}}
"""


def job_python_function() -> str:
    """``use_job_python`` of scripts/lib/job_python.sh (its one place), inlined: SLURM runs a copy of the script,
    which cannot source a file beside it."""
    text = JOB_PYTHON.read_text()
    return ("# use_job_python PYTHON: Megatron's dataset helpers built for PYTHON, pyenv or not (inlined from "
            "scripts/lib/job_python.sh)\n" + text[text.index("use_job_python() {"):].rstrip("\n"))


def render(run: RunConfig, gpus_per_node: int = GPUS_PER_NODE, source: str | None = None) -> str:
    """The sbatch script of one config (``source``: the YAML it came from, for the header)."""
    nodes, gpn = nodes_for(run, gpus_per_node)
    lay = run.layout
    # CPU mode runs the tiny GPT (256-token sequences) on another layout: the config's packer and CP layout
    # (its size-scaled knobs, e.g. --wlb-max-seq-len, belong to its sequence length)
    cpu_wlb = [f"--wlb-packer {run.packer}", f"--wlb-cp-sharding {run.cp_sharding}"]
    return TEMPLATE.format(
        source=source or f"configs/{run.name}.yaml",
        cpu_wlb_block="    " + _bash_array("CPU_WLB_ARGS", cpu_wlb).replace("\n", "\n    ").rstrip(),
        name=run.name, model=run.model.name, seq_len=run.seq_len, tp=lay.tp, cp=lay.cp, pp=lay.pp, dp=lay.dp,
        job_python=job_python_function(), world=lay.world_size, nodes=nodes, gpn=gpn, default_split=DEFAULT_SPLIT,
        model_block=_bash_array("MODEL_ARGS", model_args(run)),
        parallel_block=_bash_array("PARALLEL_ARGS", parallel_args(run)),
        wlb_block=_bash_array("WLB_ARGS", wlb_args(run, config_ref=_config_ref(source))),
    )


def _config_ref(source: str | None) -> str | None:
    """What ``--wlb-config`` names in the script: a shipped config by name, the user's YAML by absolute path."""
    if source is None or not Path(source).is_file():
        return source
    return str(Path(source).resolve())


def scaled(run: RunConfig, nproc: int | None = None, tp: int | None = None, cp: int | None = None,
           pp: int | None = None) -> RunConfig:
    """The config on another GPU count / layout (single-node trials): DP = nproc / (TP*CP*PP)."""
    from dataclasses import replace

    from megatron_wlb.costmodel import ParallelLayout

    lay = run.layout
    tp, cp, pp = tp or lay.tp, cp or lay.cp, pp or lay.pp
    nproc = nproc or tp * cp * pp * lay.dp
    if nproc % (tp * cp * pp):
        raise ValueError(f"{nproc} GPUs are not a multiple of TP*CP*PP = {tp}*{cp}*{pp}; "
                         "choose TP/CP/PP whose product divides the GPU count")
    if run.model.num_heads % tp or run.model.num_layers % pp:
        raise ValueError(f"{run.name}: TP={tp} must divide {run.model.num_heads} heads and PP={pp} the "
                         f"{run.model.num_layers} layers")
    dp = nproc // (tp * cp * pp)
    layout = ParallelLayout(tp=tp, cp=cp, pp=pp, dp=dp, ep=math.gcd(lay.ep, tp * cp * dp))  # EP as far as it fits
    return replace(run, layout=layout, packing=replace(run.packing, dp=layout.dp))


def fit_to_node(run: RunConfig, nproc: int) -> tuple[int, int, int]:
    """(TP, CP, PP) for ``nproc`` GPUs: the config's, the largest degree halved (PP first on ties,
    then TP, then CP) until TP*CP*PP divides ``nproc``; halving keeps the divisibility of heads,
    layers and seq_len that the config's (power-of-two) degrees have."""
    tp, cp, pp = run.layout.tp, run.layout.cp, run.layout.pp
    while nproc % (tp * cp * pp):
        largest = max(pp, tp, cp)
        if largest == 1:
            break
        if pp == largest and pp % 2 == 0:
            pp //= 2
        elif tp == largest and tp % 2 == 0:
            tp //= 2
        elif cp % 2 == 0:
            cp //= 2
        else:
            break  # odd degrees: leave it to scaled() to report
    return tp, cp, pp


def all_scripts(gpus_per_node: int = GPUS_PER_NODE) -> dict[Path, str]:
    return {OUT_DIR / f"{name}.sbatch": render(load_config(name), gpus_per_node) for name in list_configs()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", metavar="CONFIG",
                        help="one config (a shipped name or your own YAML path): write its script to --out")
    parser.add_argument("--out", metavar="FILE", help="with CONFIG: where to write its sbatch script")
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated script is missing or stale")
    parser.add_argument("--print-args", metavar="CONFIG", help="print the Megatron flags of one config and exit")
    parser.add_argument("--gpus-per-node", type=int, default=GPUS_PER_NODE)
    parser.add_argument("--nproc", type=int, help="with --print-args: GPUs of the run (DP = nproc / (TP*CP*PP))")
    for dim in ("tp", "cp", "pp"):
        parser.add_argument(f"--{dim}", type=int, help=f"with --print-args: override the config's {dim.upper()}")
    opts = parser.parse_args(argv)
    if opts.config is not None or opts.out is not None:
        if opts.config is None or opts.out is None:
            parser.error("give CONFIG and --out FILE together (one config's script), or neither (all shipped ones)")
        try:
            run = load_config(opts.config)
            text = render(run, opts.gpus_per_node, source=opts.config)
        except (ValueError, FileNotFoundError) as exc:
            print(f"make_sbatch.py: error: {exc}", file=sys.stderr)
            return 2
        out = Path(opts.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        out.chmod(0o755)
        print(f"wrote {out}")
        return 0
    if opts.print_args:
        try:
            original = load_config(opts.print_args)
            tp, cp, pp = opts.tp, opts.cp, opts.pp
            if opts.nproc and not (tp or cp or pp):
                tp, cp, pp = fit_to_node(original, opts.nproc)
            run = scaled(original, opts.nproc, tp, cp, pp)
        except (ValueError, FileNotFoundError) as exc:
            print(f"make_sbatch.py: error: {exc}", file=sys.stderr)
            return 2
        print(" ".join(model_args(run) + parallel_args(run) + wlb_args(run, original)))
        return 0
    stale = []
    for path, text in all_scripts(opts.gpus_per_node).items():
        if opts.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.name)
            continue
        path.write_text(text)
        path.chmod(0o755)
        print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print(f"stale or missing: {', '.join(stale)}; run python scripts/slurm/make_sbatch.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
