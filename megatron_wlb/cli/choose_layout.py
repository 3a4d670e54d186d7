"""``wlb analyze --choose-layout``: your corpus, model and GPUs in; the fastest TP/CP/PP/DP, packing and CP sharding
out, with the Megatron flags to run it.

The search is ``sim.layout_search`` (every valid layout, simulated by the one simulator); the memory of a layout is
megatron-core's own accounting (``megatron/training/theoretical_memory_usage.py``): Megatron's parser reads the
flags this command prints for the layout, the fields ``validate_args`` derives are set as it sets them, and
``compute_weight_and_optimizer_memory`` + ``compute_activation_memory`` (or ``..._without_sp``, as
``report_theoretical_memory`` chooses) are called at the layout's largest packed micro-batch: ``seq_length`` =
ceil(S_max / CP), the tokens of one CP rank (Megatron's formula divides by TP itself and does not know CP), and
``data_parallel_size`` = DP x CP, the ranks the distributed optimizer shards over (its ``intra_dp_cp_group``).
megatron-core and torch are imported on first use, so the rest of the package needs neither.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from functools import cache
from typing import Any

from megatron_wlb.cli.common import cost_profile, output_file, positive, seeds_from
from megatron_wlb.config import CpConfig, RunConfig, load_config
from megatron_wlb.costmodel import CalibratedCostModel, CostModel, build_cost_model, fit_profile, load_profile
from megatron_wlb.megatron.args.flags import config_flags  # the --wlb-* flags of a config (no torch)
from megatron_wlb.requirements import MissingDependency
from megatron_wlb.sim.experiments import Method, compare
from megatron_wlb.sim.iteration import split_documents
from megatron_wlb.sim.layout_search import (
    GPUS_PER_NODE,
    Candidate,
    LayoutChoice,
    MemoryNeed,
    SearchResult,
    enumerate_layouts,
    layout_config,
    micro_batch_tokens,
    search,
)

#: iterations simulated per layout and packing (the corpus' first ones, the same documents for every candidate)
DEFAULT_ITERATIONS = 8
#: candidates printed (every one is in --json)
DEFAULT_TOP = 8
#: the recompute settings megatron-core's accounting models (report_theoretical_memory: selective recompute with
#: sequence parallelism, else the estimate without it)
RECOMPUTE = ("selective", "none")
GIB = 1024.0  # megatron-core's accounting is in MiB (NUM_BYTES_IN_MEGABYTE = 2**20)


def add_choose_args(p: argparse.ArgumentParser) -> None:
    """The ``--choose-layout`` options of ``wlb analyze``."""
    g = p.add_argument_group("choosing the layout (--choose-layout)")
    g.add_argument("--choose-layout", action="store_true",
                   help="search every TP x CP x PP x DP layout of --gpus GPUs that fits --gpu-memory, simulate each "
                        "with the packings that fit it (WLB-LLM, balanced concat-and-cut, stock concat-and-cut; "
                        "dynamic CP at PP 1), rank them by predicted tokens/s and print the best one's flags; "
                        "the model and sequence length come from --config")
    g.add_argument("--gpus", type=int, metavar="N", help="GPUs of the job (with --choose-layout)")
    g.add_argument("--gpu-memory", type=float, metavar="GIB",
                   help="usable memory per GPU in GiB, e.g. 80 (with --choose-layout; megatron-core's theoretical "
                        "figure leaves out the CUDA context, NCCL buffers and fragmentation: give what they leave)")
    g.add_argument("--gpus-per-node", type=int, default=GPUS_PER_NODE, metavar="G",
                   help=f"GPUs per node: TP stays within one (default {GPUS_PER_NODE})")
    g.add_argument("--global-batch-size", type=int, metavar="B",
                   help="sequences of seq_len tokens per iteration, Megatron's --global-batch-size at micro-batch "
                        "size 1, the same for every layout (default: the config's DP x micro_batches)")
    g.add_argument("--recompute-granularity", choices=RECOMPUTE, default="selective",
                   help="activation recompute of the run, as megatron-core's memory accounting models it "
                        "(default selective; full recompute is not modelled there)")
    g.add_argument("--current-config", metavar="NAME|YAML",
                   help="your current run config (same model, seq_len and GPU count): every candidate's speed-up "
                        "over it")
    g.add_argument("--top", type=int, default=DEFAULT_TOP, metavar="K",
                   help=f"candidates printed (default {DEFAULT_TOP}; --json holds all)")


# -- megatron-core's memory accounting ----------------------------------------------------------------------
@cache
def megatron_memory_module() -> tuple[Any, Any, Any]:
    """(theoretical_memory_usage, add_megatron_arguments, calculate_padded_vocab_size) of the installed
    megatron-core; a one-line error naming what to install when it (or torch) is missing."""
    from megatron_wlb.megatron.args.compat import install_python_shims

    try:
        install_python_shims()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # megatron-core's import warns about optional kernels
            from megatron.training import theoretical_memory_usage
            from megatron.training.arguments import add_megatron_arguments
            from megatron.training.vocab_utils import calculate_padded_vocab_size
    except (ImportError, RuntimeError) as exc:
        raise MissingDependency(f"--choose-layout prices memory with megatron-core's own accounting, which is not "
                                f"importable here ({exc}): pip install megatron-core torch") from None
    return theoretical_memory_usage, add_megatron_arguments, calculate_padded_vocab_size


@cache
def megatron_parser() -> argparse.ArgumentParser:
    """Megatron's own argument parser (``add_megatron_arguments``), built once."""
    _, add_megatron_arguments, _ = megatron_memory_module()
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    return parser


def model_flags(cfg: RunConfig) -> list[str]:
    """Megatron's flags for the config's model shape (Llama-style: RoPE, RMSNorm, no biases, untied embeddings,
    as ``scripts/slurm/make_sbatch.py`` launches it)."""
    m = cfg.model
    flags = ["--num-layers", str(m.num_layers), "--hidden-size", str(m.hidden), "--num-attention-heads",
             str(m.num_heads), "--ffn-hidden-size", str(m.ffn_hidden), "--max-position-embeddings", str(cfg.seq_len),
             "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--disable-bias-linear",
             "--untie-embeddings-and-output-weights", "--vocab-size", str(m.vocab)]
    if m.num_kv_heads != m.num_heads:
        flags += ["--group-query-attention", "--num-query-groups", str(m.num_kv_heads)]
    if m.swiglu:
        flags.append("--swiglu")
    if m.kv_channels is not None:
        flags += ["--kv-channels", str(m.kv_channels)]
    if m.is_moe:
        flags += ["--num-experts", str(m.num_experts), "--moe-router-topk", str(m.moe_topk),
                  "--moe-ffn-hidden-size", str(m.expert_ffn_hidden)]
        if m.moe_shared_expert_hidden is not None:
            flags += ["--moe-shared-expert-intermediate-size", str(m.moe_shared_expert_hidden)]
        if m.moe_layer_freq != 1:
            freq = m.moe_layer_freq
            flags += ["--moe-layer-freq", str(freq) if isinstance(freq, int) else "[" + ",".join(map(str, freq)) + "]"]
    return flags


def layout_flags(cfg: RunConfig, recompute: str) -> list[str]:
    """The Megatron flags of ``cfg``'s layout and batch: TP, CP, PP (and VPP), --seq-length, micro-batch size 1
    (packed), --global-batch-size, sequence parallelism at TP > 1, the distributed optimizer, the recompute."""
    lay = cfg.layout
    flags = ["--tensor-model-parallel-size", str(lay.tp), "--context-parallel-size", str(lay.cp),
             "--pipeline-model-parallel-size", str(lay.pp)]
    if cfg.virtual_stages > 1:
        flags += ["--num-layers-per-virtual-pipeline-stage", str(cfg.model.num_layers // (lay.pp * cfg.virtual_stages))]
    if lay.ep > 1:
        flags += ["--expert-model-parallel-size", str(lay.ep)]
    flags += ["--seq-length", str(cfg.seq_len), "--micro-batch-size", "1", "--global-batch-size",
              str(cfg.micro_batches * lay.dp), "--use-distributed-optimizer", "--bf16"]
    if lay.tp > 1:
        flags.append("--sequence-parallel")
    if recompute != "none":
        flags += ["--recompute-granularity", recompute]
    return flags


def megatron_namespace(cfg: RunConfig, tokens: int, recompute: str) -> argparse.Namespace:
    """Megatron's args for ``cfg`` on its layout (its parser over ``model_flags`` + ``layout_flags``, then what
    ``validate_args`` derives: world size, padded vocabulary, VPP, expert TP, kv_channels, no SP at TP 1) at a
    micro-batch of ``tokens``: ``seq_length`` = ceil(tokens / CP), one CP rank's share; ``data_parallel_size`` =
    DP x CP, the group the distributed optimizer shards its state over."""
    _, _, padded_vocab = megatron_memory_module()
    args = megatron_parser().parse_args(model_flags(cfg) + layout_flags(cfg, recompute))
    lay = cfg.layout
    args.world_size = lay.world_size
    # the distributed optimizer shards over the DP x CP group (megatron-core's optimizer: intra_dp_cp_group); the
    # accounting's data_parallel_size is that group (validate_args' world / (TP x PP x CP) would leave CP out)
    args.data_parallel_size = lay.world_size // (lay.tp * lay.pp)
    args.padded_vocab_size = padded_vocab(cfg.model.vocab, args.make_vocab_size_divisible_by, lay.tp,
                                          logging_enabled=False)
    args.virtual_pipeline_model_parallel_size = cfg.virtual_stages if cfg.virtual_stages > 1 else None
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = lay.tp
    if args.kv_channels is None:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if lay.tp == 1:
        args.sequence_parallel = False
    args.seq_length = math.ceil(tokens / lay.cp)
    return args


def megatron_memory(cfg: RunConfig, tokens: int, recompute: str = "selective") -> MemoryNeed:
    """Per-GPU GiB of ``cfg``'s most loaded rank at micro-batches of ``tokens``, by megatron-core's
    ``theoretical_memory_usage`` (the activation estimate ``report_theoretical_memory`` chooses)."""
    tmu, _, _ = megatron_memory_module()
    args = megatron_namespace(cfg, tokens, recompute)
    weights = tmu.compute_weight_and_optimizer_memory(args) / tmu.NUM_BYTES_IN_MEGABYTE
    if args.sequence_parallel and args.recompute_granularity == "selective":
        activations = tmu.compute_activation_memory(args, num_microbatches=cfg.micro_batches)
    else:
        activations = tmu.compute_activation_memory_without_sp(args, num_microbatches=cfg.micro_batches)
    return MemoryNeed(weights / GIB, activations / tmu.NUM_BYTES_IN_MEGABYTE / GIB)


# -- the command ------------------------------------------------------------------------------------------------
def check_choose_args(args: argparse.Namespace) -> None:
    """One line for a bad --choose-layout value, before any work."""
    if args.gpus is None or args.gpu_memory is None:
        raise ValueError("--choose-layout needs --gpus N and --gpu-memory GIB (e.g. --gpus 8 --gpu-memory 80)")
    positive(args.gpus, "--gpus")
    if not (args.gpu_memory > 0 and math.isfinite(args.gpu_memory)):
        raise ValueError(f"--gpu-memory {args.gpu_memory:g}: must be a positive number of GiB per GPU (e.g. 80)")
    positive(args.gpus_per_node, "--gpus-per-node")
    positive(args.top, "--top")
    if args.global_batch_size is not None:
        positive(args.global_batch_size, "--global-batch-size")
    if args.iterations is not None:
        positive(args.iterations, "--iterations")
    if args.sft or args.sft_jsonl:
        raise ValueError("--choose-layout simulates pretraining documents; it does not take --sft/--sft-jsonl")


def cost_factory(profile: str | None) -> tuple[Any, str]:
    """(config -> its cost model, how the report names the model): analytic without a profile; a profile is
    loaded and fitted once."""
    if profile is None:
        return (lambda cfg: build_cost_model(cfg.model, cfg.layout)), (
            "analytic (FLOPs over an H100's achieved rates; no --cost-profile: rank with a calibrated profile "
            "from `wlb calibrate` for your GPUs)")
    prof = load_profile(profile)
    fit = fit_profile(prof)

    def of(cfg: RunConfig) -> CostModel:
        return CalibratedCostModel(prof, cfg.model, cfg.layout, fit=fit)

    return of, f"calibrated ({profile})"


def current_throughput(current: RunConfig, lengths: Any, iterations: int, cost_of: Any) -> tuple[float, str]:
    """(tokens/s, label) of the user's current config on the same documents: its layout, packer and CP sharding
    (dynamic CP is simulated adaptive here: the planner runs at PP 1 only)."""
    sharding = "adaptive" if current.cp_sharding == "dynamic" else current.cp_sharding
    method = Method("current", current.packer, sharding)
    run = compare(current, lengths, iterations, [method], cost=cost_of(current)).runs["current"]
    return run.throughput, f"{current.name} ({current.layout}, {current.packer}, {sharding})"


def check_current(current: RunConfig, cfg: RunConfig, gpus: int) -> None:
    """One line when ``--current-config`` is not the same job on the same GPUs (its model, seq_len, GPU count)."""
    if (current.model, current.seq_len) != (cfg.model, cfg.seq_len):
        raise ValueError(f"--current-config {current.name}: its model ({current.model.name}) and seq_len "
                         f"({current.seq_len}) must be --config's ({cfg.model.name}, {cfg.seq_len})")
    if current.layout.world_size != gpus:
        raise ValueError(f"--current-config {current.name}: its layout {current.layout} has "
                         f"{current.layout.world_size} GPUs, not --gpus {gpus}")


def why(c: Candidate, ref: Candidate | None, gpu_memory: float) -> str:
    """What sets ``c`` apart from ``ref`` (the next layout down, or the best): bubbles, imbalance, CP
    communication, memory headroom."""
    parts = []
    head = gpu_memory - c.memory.total_gib
    if math.isnan(c.bubble_fraction):  # dynamic CP: what the planner saved over the fixed groups
        parts.append(c.note.split(" (sim.dyncp)")[0])
    elif ref is not None and math.isnan(ref.bubble_fraction):
        parts.append(f"bubble {c.bubble_fraction:.0%}, GPU imbalance {c.gpu_imbalance:.2f}, "
                     f"CP comm {c.cp_comm_share:.0%}")
    elif ref is not None:
        if abs(c.bubble_fraction - ref.bubble_fraction) >= 0.02:
            parts.append(f"bubble {c.bubble_fraction:.0%} vs {ref.bubble_fraction:.0%}")
        if abs(c.pp_imbalance - ref.pp_imbalance) >= 0.02:
            parts.append(f"micro-batch imbalance {c.pp_imbalance:.2f} vs {ref.pp_imbalance:.2f}")
        if abs(c.gpu_imbalance - ref.gpu_imbalance) >= 0.02:
            parts.append(f"GPU imbalance {c.gpu_imbalance:.2f} vs {ref.gpu_imbalance:.2f}")
        if abs(c.cp_comm_share - ref.cp_comm_share) >= 0.01:
            parts.append(f"CP comm {c.cp_comm_share:.0%} vs {ref.cp_comm_share:.0%}")
        if abs(c.memory.total_gib - ref.memory.total_gib) >= 1.0 and c.choice == ref.choice:
            parts.append(f"{c.memory.total_gib:.0f} vs {ref.memory.total_gib:.0f} GiB")
    if head < 0.1 * gpu_memory:
        parts.append(f"tight memory ({head:.1f} GiB headroom)")
    return "; ".join(parts)


def candidate_config(cfg: RunConfig, c: Candidate, profile: str | None) -> RunConfig:
    """``cfg`` on the candidate's layout with its packer, packing overrides and CP sharding (for --wlb-* flags)."""
    at = layout_config(cfg, c.choice)
    overrides = c.method.packing_overrides(at)
    run = replace(at, packer=c.method.packer, packing=replace(at.packing, **overrides), cp=CpConfig(c.cp_sharding))
    if profile is not None:
        run = replace(run, cost=replace(run.cost, profile=profile))
    return run


def run_choose(args: argparse.Namespace, read_corpus: Callable[..., Any]) -> int:
    """``wlb analyze --choose-layout``; ``read_corpus``: ``wlb analyze``'s corpus reader (``cli.analyze``)."""

    check_choose_args(args)
    cfg = load_config(args.config)
    current = load_config(args.current_config) if args.current_config else None
    if current is not None:
        check_current(current, cfg, args.gpus)
    profile = cost_profile(args.cost_profile, config=cfg)
    json_out = output_file(args.json, "--json") if args.json else None
    global_batch = args.global_batch_size or cfg.micro_batches * cfg.layout.dp
    choices = enumerate_layouts(cfg.model, cfg.seq_len, args.gpus, global_batch, gpus_per_node=args.gpus_per_node,
                                virtual_stages=cfg.virtual_stages, ep=cfg.layout.ep)
    if not choices:
        raise ValueError(f"--gpus {args.gpus}: no layout TP x CP x PP x DP = {args.gpus} fits {cfg.name} (TP <= "
                         f"{args.gpus_per_node} dividing {cfg.model.num_heads} heads and {cfg.model.num_kv_heads} KV "
                         f"heads, PP dividing {cfg.model.num_layers} layers, DP dividing --global-batch-size "
                         f"{global_batch}); try another GPU count or global batch")
    start = time.perf_counter()
    seeds = seeds_from(args.seed, 1)
    corpus = read_corpus(args, seeds, command="wlb analyze")
    lengths = corpus.streams[0]
    tokens = int(split_documents(lengths, cfg.seq_len).sum())
    available = tokens // (global_batch * cfg.seq_len)
    if available < 1:
        raise ValueError(f"the corpus holds {tokens:,} tokens, less than one iteration of {global_batch} x "
                         f"{cfg.seq_len} tokens; use a larger corpus or a smaller --global-batch-size")
    iterations = min(args.iterations or DEFAULT_ITERATIONS, available)
    cost_of, cost_line = cost_factory(profile)
    print(f"wlb analyze: {len(choices)} layouts of {args.gpus} GPUs for {cfg.name}; megatron-core's memory "
          "accounting loads (torch) ...", file=sys.stderr)
    megatron_memory_module()

    def progress(line: str) -> None:
        print(f"wlb analyze: [{time.perf_counter() - start:5.0f} s] {line}", file=sys.stderr, flush=True)

    result = search(cfg, lengths, choices, iterations, args.gpu_memory,
                    lambda c, t: megatron_memory(c, t, args.recompute_granularity), cost_of, progress=progress)
    base, base_label = (current_throughput(current, lengths, iterations, cost_of)
                        if current is not None else (None, None))
    notes = [f"Cost model: {cost_line}.",
             f"Corpus: {corpus.source}; {iterations} iterations of {global_batch} x {cfg.seq_len} tokens per "
             f"candidate, the same documents for each (seed {seeds[0]}; documents over seq_len cut at it).",
             f"Memory: megatron-core's theoretical_memory_usage (distributed optimizer, recompute "
             f"{args.recompute_granularity}) at the largest packed micro-batch, S_max / CP tokens a rank.",
             *corpus.notes, *result.notes]
    flags = None
    if result.candidates:
        best = result.candidates[0]
        run = candidate_config(cfg, best, profile)
        flags = {"megatron": layout_flags(run, args.recompute_granularity), "wlb": config_flags(run)}
    print_result(cfg, args, result, base, base_label, flags, notes)
    print(f"\n{len(result.candidates)} candidates over {result.layouts} layouts in "
          f"{time.perf_counter() - start:.0f} s", file=sys.stderr)
    if json_out is not None:
        with open(json_out, "w") as f:
            json.dump({"config": cfg.name, "gpus": args.gpus, "gpu_memory_gib": args.gpu_memory,
                       "global_batch_size": global_batch, "iterations": iterations, "cost_model": cost_line,
                       "analytic": profile is None, "layouts": result.layouts,
                       "current": {"config": base_label, "tokens_per_second": base} if base is not None else None,
                       "candidates": [{**c.to_json(args.gpu_memory),
                                       **({"speedup_over_current": c.tokens_per_second / base} if base else {}),
                                       "wlb_flags": config_flags(candidate_config(cfg, c, profile))}
                                      for c in result.candidates],
                       "unfit": [{"label": u.choice.label, "memory_gib": u.memory.total_gib,
                                  "weights_gib": u.memory.weights_gib, "activations_gib": u.memory.activations_gib}
                                 for u in result.unfit],
                       "best_flags": flags, "notes": notes}, f, indent=1)
    return 0


def shown_as(value: float, spec: str) -> str:
    """``value`` formatted, or "-" where the simulation gives none (NaN)."""
    return "-" if math.isnan(value) else format(value, spec)


def print_result(cfg: RunConfig, args: argparse.Namespace, result: SearchResult, base: float | None,
                 base_label: str | None, flags: dict[str, list[str]] | None, notes: list[str]) -> None:
    """The ranking, the best layout's flags and the layouts that do not fit, on stdout."""
    print(f"Layouts for {cfg.name} on {args.gpus} GPUs of {args.gpu_memory:g} GiB, ranked by predicted tokens/s "
          f"({'analytic cost model' if 'analytic' in notes[0] else 'calibrated cost model'})\n")
    cols = ["rank", "layout", "packing", "CP sharding", "tokens/s", "vs best"] + (["vs current"] if base else []) + \
        ["bubble", "mb imb.", "GPU imb.", "CP comm", "GiB", "why (vs the best; the best: vs the next layout)"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    shown = result.candidates[:args.top]
    best = shown[0] if shown else None
    for i, c in enumerate(shown):
        ref = next((o for o in result.candidates if o.choice != c.choice), None) if i == 0 else best
        cells = [str(i + 1), c.choice.label, c.method.name, c.cp_sharding, f"{c.tokens_per_second:,.0f}",
                 f"{c.tokens_per_second / best.tokens_per_second:.3f}" if best else "-"]
        if base:
            cells.append(f"{c.tokens_per_second / base:.3f}")
        cells += [shown_as(c.bubble_fraction, ".0%"), shown_as(c.pp_imbalance, ".2f"), shown_as(c.gpu_imbalance, ".2f"),
                  shown_as(c.cp_comm_share, ".0%"), f"{c.memory.total_gib:.1f}", why(c, ref, args.gpu_memory)]
        print("| " + " | ".join(cells) + " |")
    if not shown:
        print(f"\nNo layout of {args.gpus} GPUs fits {args.gpu_memory:g} GiB: add GPUs, memory or recompute.")
    if base is not None:
        print(f"\nCurrent: {base_label}: {base:,.0f} tokens/s; the best is {shown[0].tokens_per_second / base:.3f}x "
              "it." if shown else f"\nCurrent: {base_label}: {base:,.0f} tokens/s.")
    if flags is not None and best is not None:
        print(f"\nBest: {best.choice.label}, {best.method.name}, CP sharding {best.cp_sharding}"
              + (f" ({best.note})" if best.note else "") + ". Megatron flags (with your model's):\n")
        print("  " + " ".join(flags["megatron"]) + " \\\n  " + " ".join(flags["wlb"]))
    if result.unfit:
        print(f"\nLayouts that do not fit {args.gpu_memory:g} GiB (GiB needed at seq_len-token micro-batches): "
              + ", ".join(f"{u.choice.label} ({u.memory.total_gib:.1f})" for u in result.unfit))
    print("\n" + "\n".join(f"- {n}" for n in notes))


__all__ = ["LayoutChoice", "add_choose_args", "megatron_memory", "megatron_namespace", "run_choose",
           "micro_batch_tokens"]
