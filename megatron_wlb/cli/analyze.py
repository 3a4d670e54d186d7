"""``wlb analyze``: what WLB-LLM buys on your own data and layout, before spending a cluster on it.

The corpus is read whole (``--lengths``, ``--data-prefix`` or a ``--data-path`` blend as Megatron
takes it; an indexed corpus through the training reader, checked and memory-mapped) or, past
``--max-documents``, a uniform sample of its documents (said in the report and the JSON: how many of
how many; the first documents of a uniformly shuffled corpus are such a sample), shuffled as
Megatron's GPTDataset shuffles documents (numpy ``RandomState`` seeded with ``--seed`` + k for
ordering k), and every method runs the same iterations of each ordering; the
verdict is the mean and range over ``--shuffles`` orderings, so it does not hinge on the file order.
The concat-and-cut baseline and the balanced concat-and-cut train megatron-core's own GPTDataset
samples of the corpus (seed ``--seed`` + k), global batch after global batch as Megatron's sampler
gives them (``megatron.sample_orders``); without megatron-core they cut the reader's order, said in one line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_wlb.cli.analyze_sft import add_sft_args, run_sft
from megatron_wlb.cli.choose_layout import add_choose_args, run_choose
from megatron_wlb.cli.common import (
    add_stream_args,
    corpus_sample,
    cost_profile,
    load_stream,
    output_dir,
    output_file,
    positive,
    seeds_from,
    tqdm_progress,
    with_virtual_stages,
)
from megatron_wlb.config import RunConfig, list_configs, load_config
from megatron_wlb.costmodel import build_cost_model
from megatron_wlb.cp.dynamic import DYNAMIC_SHARDING
from megatron_wlb.data import load_lengths
from megatron_wlb.data.blend import DEFAULT_SEED, parse_data_path, read_blend, shuffle_documents
from megatron_wlb.data.samples import SampleStream
from megatron_wlb.sim.dyncp import simulate_dynamic_stream
from megatron_wlb.sim.experiments import EQUAL_DELAY_WINDOW, PAPER_VIRTUAL_STAGES
from megatron_wlb.sim.iteration import split_documents
from megatron_wlb.sim.moe import attention_shares, moe_table, share_summary
from megatron_wlb.sim.report import Verdict, analyze, recommendation

#: Orderings per verdict. With k i.i.d. orderings each, two corpora of the same documents in
#: different file orders give disjoint [min, max] ranges with probability 2 (k!)^2 / (2k)!:
#: 10% for k = 3, under 1% for k = 5.
DEFAULT_SHUFFLES = 5
#: documents of an indexed corpus analyzed at most: past it a uniform sample of that many is read (8 bytes a
#: document per copy, a few copies; the simulation's time grows with it too)
DEFAULT_MAX_DOCUMENTS = 1_000_000


def smaller_config_advice(tokens: int) -> str:
    """Which shipped config a corpus of ``tokens`` tokens gives at least one iteration of (the largest such), or
    how to write one where none does."""
    sizes = {name: load_config(name).packing.tokens_per_iteration for name in list_configs()}
    fits = [name for name in sizes if sizes[name] <= tokens]
    if fits:
        best = max(fits, key=lambda name: (sizes[name], name))
        return f"a config whose iteration fits: --config {best} ({sizes[best]:,} tokens an iteration)"
    smallest = min(sizes, key=lambda name: (sizes[name], name))
    return (f"a YAML config with a smaller seq_len or layout (the smallest shipped, {smallest}, needs "
            f"{sizes[smallest]:,} tokens an iteration)")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("analyze", help="compare Plain-4D / Fixed-4D / WLB-LLM on your data and layout",
                              description="Simulate the two Plain-4D baselines (concat-and-cut, whole-document), "
                                          f"fixed-length greedy over {EQUAL_DELAY_WINDOW} global batches (the "
                                          "baseline at equal delay), Fixed-4D, WLB-LLM, balanced concat-and-cut "
                                          "and Megatron's dynamic CP on your documents (shuffled as Megatron "
                                          "does, several seeds) and run config; print the verdict (mean and "
                                          "range over the shuffles) and write DIR/report.md with figures.",
                              epilog="Printed numbers: speedup = simulated tokens per second of a method over "
                                     "a baseline's on the same iterations (1.10 = 10%% faster); mean [min, "
                                     "max] over the shuffles; mean delay = iterations a token waits past its "
                                     "arrival, token-weighted; every number under the schedule named beside "
                                     "it (the config's virtual_stages, default plain 1F1B; the README's headline "
                                     f"and `wlb reproduce` run the paper's interleaved v = {PAPER_VIRTUAL_STAGES}).")
    group = add_stream_args(p)
    group.add_argument("--data-path", nargs="+", metavar="W_OR_PREFIX",
                       help="Megatron-style blend: 'PREFIX' or 'W1 PREFIX1 W2 PREFIX2 ...' (weights are "
                            "normalised; without weights the datasets are concatenated)")
    p.add_argument("--config", required=True, help="config name (configs/*.yaml stem) or YAML path")
    p.add_argument("--cost-profile", metavar="JSON",
                   help="cost-model profile measured on a GPU (format megatron-wlb-profile/1)")
    p.add_argument("--out", default="wlb-analyze", metavar="DIR", help="output folder (default ./wlb-analyze)")
    p.add_argument("--iterations", type=int,
                   help="iterations per ordering and method (default: every full iteration the corpus gives)")
    p.add_argument("--shuffles", type=int, default=DEFAULT_SHUFFLES,
                   help=f"seeded document orderings to average over (default {DEFAULT_SHUFFLES})")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"first shuffle seed (default {DEFAULT_SEED})")
    p.add_argument("--no-shuffle", action="store_true",
                   help="keep the corpus in file order (one ordering; the verdict then depends on that order)")
    p.add_argument("--virtual-stages", type=int, metavar="V",
                   help="interleaved 1F1B with V virtual stages, 1 = plain 1F1B (default: the config's "
                        f"virtual_stages, as every command; {PAPER_VIRTUAL_STAGES} is the README headline's)")
    p.add_argument("--json", metavar="FILE", help="also write the verdict as JSON")
    p.add_argument("--max-documents", type=int, default=DEFAULT_MAX_DOCUMENTS, metavar="N",
                   help="with --data-prefix/--data-path: analyze at most N documents; a larger corpus is sampled "
                        "uniformly (seeded by --seed; the same share of each dataset of a blend), and the report "
                        f"says how many of how many (default {DEFAULT_MAX_DOCUMENTS:,})")
    p.add_argument("--split", default="1,0,0", metavar="S",
                   help="with --data-prefix/--data-path: your job's --split (GPTDataset's train split; default 1,0,0)")
    p.add_argument("--data-cache-path", default=None, metavar="DIR",
                   help="with --data-prefix/--data-path: your job's --data-cache-path (GPTDataset's indices are shared "
                        "with it; default: built in a temporary folder)")
    add_sft_args(p)
    add_choose_args(p)
    p.set_defaults(func=run)


def gpt_samples(corpus: np.ndarray | list[str] | str, seq_len: int, num_samples: int, seeds: list[int],
                split: str = "1,0,0", cache: str | None = None) -> tuple[list[SampleStream] | None, str]:
    """Per ordering (seed), megatron-core's GPTDataset samples of ``corpus`` as a piece stream, and the
    report's line saying so; without megatron-core (or torch), None and the line saying what that changes.

    The concat-and-cut baseline and the balanced concat-and-cut then train exactly the samples the
    user's ``pretrain_gpt.py`` job would, iteration by iteration, so the verdict is about that job."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # megatron-core's import warns about optional kernels
            import megatron.core.datasets.gpt_dataset  # noqa: F401
    except ImportError as e:
        return None, (f"megatron-core is not importable here ({e}): the concat-and-cut baseline and the balanced "
                      "concat-and-cut follow this tool's document order, not Megatron GPTDataset's sample order; "
                      "install megatron-core and torch (pip install megatron-core torch) for the exact order.")
    from megatron_wlb.megatron.data.sample_orders import gpt_sample_order, sample_stream  # megatron-core: optional

    streams = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for seed in seeds:
            order, name = gpt_sample_order(corpus, seq_len, num_samples, seed, split=split, path_to_cache=cache)
            streams.append(sample_stream(order, name))
    return streams, (f"Concat-and-cut and balanced concat-and-cut train megatron-core's GPTDataset samples (its "
                     f"document, sample and shuffle indices, --seed {seeds[0]}" + (f"..{seeds[-1]}" if len(seeds) > 1
                                                                                   else "") +
                     f", --split {split}, per-document masking), global batch after global batch as Megatron's "
                     "sampler gives them; the balanced one trains no sample before the iteration it is given.")


@dataclass
class CorpusRead:
    """What ``read_corpus`` read: per ordering the document lengths (``streams``), the report's ``source``
    line and ``notes``, the corpus as megatron-core reads it (``corpus``: the prefix or blend, or the lengths),
    ``sample`` = (documents read, documents in the corpus) when sampled, and ``documents`` in the corpus."""

    streams: list[np.ndarray]
    source: str
    notes: list[str]
    corpus: np.ndarray | list[str] | str
    sample: tuple[int, int] | None
    documents: int


def read_corpus(args: argparse.Namespace, seeds: list[int], command: str = "wlb analyze") -> CorpusRead:
    """The corpus of ``--lengths`` / ``--data-prefix`` / ``--data-path`` (the embedded stream by default), past
    ``--max-documents`` a uniform sample of it, in one ordering per seed (``--no-shuffle``: file order)."""
    notes: list[str] = []
    lengths = np.zeros(0, dtype=np.int64)  # the file-order lengths (--lengths / --data-prefix / embedded)
    # the corpus as megatron-core reads it: the prefix or blend itself (its IndexedDataset), or the lengths
    corpus: np.ndarray | list[str] | str | None = args.data_path or args.data_prefix
    sample: tuple[int, int] | None = None  # (documents read, documents in the corpus) when sampled
    if args.data_path or args.data_prefix:

        prefixes = [prefix for prefix, _ in parse_data_path(args.data_path)] if args.data_path else [args.data_prefix]
        flag = "--data-path" if args.data_path else "--data-prefix"
        datasets, read, total = corpus_sample(prefixes, flag, args.max_documents, seeds[0])
        if read < total:
            sample = (read, total)
            line = (f"A sample: {read:,} of the corpus' {total:,} documents ({read / total:.2%}, over "
                    f"--max-documents {args.max_documents:,}), drawn uniformly without replacement (seed {seeds[0]}"
                    f"{', the same share of each dataset' if len(prefixes) > 1 else ''}); every ordering and "
                    "method reads that sample (the first documents of a uniformly shuffled corpus are such a sample).")
            notes.append(line)
            print(f"{command}: note: {line}", file=sys.stderr)
    if args.data_path:

        streams = []
        for seed in seeds:
            stream, desc, unused = read_blend(args.data_path, None if args.no_shuffle else seed, datasets=datasets)
            streams.append(stream)
        source = f"blend {desc}"
        if unused:
            notes.append(f"The blend ends when its first dataset runs out (no document repeats), so {unused:,} "
                         "documents of the others are not read.")
        if sample is not None:  # megatron-core samples the sample, blended (it shuffles it per seed itself)
            corpus = read_blend(args.data_path, None, datasets=datasets)[0]
    else:

        if args.data_prefix:
            lengths = datasets[0]
            source = f"{args.data_prefix}.idx ({lengths.size:,} documents" + (
                f" of {sample[1]:,}, a uniform sample)" if sample is not None else ")")
            if sample is not None:
                corpus = lengths
        else:
            lengths, source = load_stream(args)
            corpus = lengths
        streams = [lengths] if args.no_shuffle else [shuffle_documents(lengths, seed) for seed in seeds]
    # documents in the corpus (a blend: in all its datasets; it may read fewer, as noted)
    documents = total if args.data_path or args.data_prefix else int(lengths.size)
    assert corpus is not None
    return CorpusRead(streams, source, notes, corpus, sample, documents)


def run(args: argparse.Namespace) -> int:
    if args.choose_layout:  # the layout search (cli.choose_layout), on the same corpus reader
        return run_choose(args, read_corpus)
    if args.sft or args.sft_jsonl:  # fine-tuning conversations: Megatron's SFT grouping, KK and the packer
        return run_sft(args)

    # every input is checked before any work: the simulation takes minutes
    if args.iterations is not None:
        positive(args.iterations, "--iterations")
    positive(args.shuffles, "--shuffles")
    positive(args.max_documents, "--max-documents")
    seeds = seeds_from(args.seed, 1 if args.no_shuffle else args.shuffles)
    cfg = with_virtual_stages(load_config(args.config), args.virtual_stages)
    profile = cost_profile(args.cost_profile, config=cfg)
    out = output_dir(args.out)
    json_out = output_file(args.json, "--json") if args.json else None
    corpus_read = read_corpus(args, seeds)
    notes, streams, source = corpus_read.notes, corpus_read.streams, corpus_read.source
    corpus, sample, documents = corpus_read.corpus, corpus_read.sample, corpus_read.documents
    order = ("file order (not shuffled)" if args.no_shuffle else
             f"{len(seeds)} shuffles as Megatron's GPTDataset orders documents (numpy RandomState, seeds "
             f"{seeds[0]}..{seeds[-1]})")
    notes.append(f"Document order: {order}.")
    longer = int((streams[0] > cfg.seq_len).sum())
    if longer:
        notes.append(f"{longer:,} documents longer than seq_len = {cfg.seq_len} are cut into windows of at most "
                     "seq_len tokens for every method alike.")
    tokens = int(split_documents(streams[0], cfg.seq_len).sum())
    per_iteration = cfg.packing.tokens_per_iteration
    available = tokens // per_iteration
    if available < 1:
        raise ValueError(f"the corpus holds {tokens:,} tokens, less than one iteration of {cfg.name} "
                         f"({per_iteration:,} tokens); use a larger corpus or {smaller_config_advice(tokens)}")
    iterations = available if args.iterations is None else min(args.iterations, available)
    if args.iterations is None:
        notes.append(f"The whole corpus: {iterations} full iterations of {per_iteration:,} tokens "
                     f"({tokens:,} tokens).")
    elif args.iterations > available:
        warning = (f"--iterations {args.iterations} asked for more than the corpus holds: it gives "
                   f"{available} full iterations of {per_iteration:,} tokens, so {available} were run.")
        print(f"wlb analyze: warning: {warning}", file=sys.stderr)
        notes.append(f"**Warning:** {warning}")
    else:
        notes.append(f"A sample: the first {iterations} of the {available} full iterations the corpus gives, "
                     "in each ordering.")
    assert corpus is not None
    if sample is not None and args.data_cache_path:
        notes.append("--data-cache-path is not used for a sample (megatron-core's indices of the sample are built "
                     "in a temporary folder).")
    samples, line = gpt_samples(corpus, cfg.seq_len, iterations * cfg.packing.micro_batches_per_iteration, seeds,
                                args.split, None if sample is not None else args.data_cache_path)
    notes.append(line)
    if samples is None:
        print(f"wlb analyze: note: {line}", file=sys.stderr)
    start = time.perf_counter()
    path, table, verdict = analyze(out, cfg, streams, iterations, profile=profile, progress=tqdm_progress,
                                   source=source, reference=load_lengths(), notes=notes, samples=samples)
    print(f"{table.title}\n")
    print(table.to_markdown(digits=3))
    for line in recommendation(verdict):
        print(f"\n{line}")
    analyzed, in_corpus = sample if sample is not None else (documents, documents)
    of = f", a uniform sample of {analyzed:,} of its {in_corpus:,} documents" if sample is not None else ""
    moe: dict | None = None
    if cfg.model.is_moe:  # the same corpus, orderings and samples under the dense model of equal active parameters
        moe = moe_beside_dense(out, cfg, streams, iterations, profile, source, notes, samples, path, verdict)
    dynamic = dynamic_beside(cfg, profile, streams, iterations, path)
    print(f"\n{verdict.iterations} iterations x {verdict.shuffles} orderings per method, {verdict.schedule}{of}; "
          f"wrote {path} and its figures in {time.perf_counter() - start:.0f} s")
    if json_out is not None:
        with open(json_out, "w") as f:
            json.dump({**verdict.to_json(), "documents_analyzed": analyzed, "documents_in_corpus": in_corpus,
                       "sampled": sample is not None, "recommendation": recommendation(verdict),
                       **({"moe": moe} if moe is not None else {}), "dynamic_cp": dynamic}, f, indent=1)
    return 0


def dynamic_beside(cfg: RunConfig, profile: str | None, streams: list[np.ndarray], iterations: int,
                   report: Path) -> dict:
    """``--wlb-cp-sharding dynamic`` on the same orderings (PP 1 only: the planner plans one stage): the wlb
    packer's documents per iteration planned over the DP x CP ranks, beside the same micro-batches on fixed CP
    groups; printed, appended to ``report`` and returned as JSON (with PP > 1: the reason it is not simulated)."""
    if cfg.layout.pp != 1:
        why = (f"not simulated: the dynamic-CP planner plans one pipeline stage (PP 1), this config has PP "
               f"{cfg.layout.pp}")
        if cfg.cp_sharding == DYNAMIC_SHARDING:
            print(f"\nDynamic CP (--wlb-cp-sharding {DYNAMIC_SHARDING}): {why}")
        return {"simulated": False, "reason": why}
    cost = build_cost_model(cfg.model, cfg.layout, profile)
    runs = [simulate_dynamic_stream(cfg, cost, "wlb", split_documents(s, cfg.seq_len), iterations) for s in streams]
    over = [sum(r.time for r in run) / sum(r.ideal for r in run) for run in runs]
    gain = [sum(r.fixed for r in run) / sum(r.time for r in run) for run in runs]
    line = (f"Dynamic CP (--wlb-cp-sharding {DYNAMIC_SHARDING}, PP 1, the wlb packer's documents planned over the "
            f"{cfg.layout.dp * cfg.layout.cp} DP x CP ranks, CP communication charged): slowest rank over ideal "
            f"{np.mean(over):.3f} [{min(over):.3f}, {max(over):.3f}]; the same micro-batches on fixed CP "
            f"{cfg.layout.cp} groups take {np.mean(gain):.3f}x [{min(gain):.3f}, {max(gain):.3f}] as long "
            f"(cost model, per layer x layers)")
    print(f"\n{line}")
    with open(report, "a") as f:
        f.write(f"\n## Dynamic CP\n\n{line}\n")
    return {"simulated": True, "over_ideal": over, "fixed_group_over_dynamic": gain}


def moe_beside_dense(out: Path, cfg: RunConfig, streams: list[np.ndarray], iterations: int, profile: str | None,
                     source: str, notes: list[str], samples: list[SampleStream] | None, report: Path,
                     verdict: Verdict) -> dict:
    """Simulate ``cfg``'s dense counterpart (``RunConfig.dense_counterpart``) on the same orderings and samples,
    print the MoE job beside it (``sim.moe.moe_table``), append it to ``report`` and return it as JSON."""

    dense = cfg.dense_counterpart()
    _, _, dense_verdict = analyze(out / "dense-counterpart", dense, streams, iterations, profile=profile,
                                  progress=tqdm_progress, source=source, notes=notes, samples=samples)
    count = iterations * cfg.packing.micro_batches_per_iteration
    shares = {c.name: attention_shares(build_cost_model(c.model, c.layout, profile), streams[0], c.seq_len, count)
              for c in (cfg, dense)}
    table = moe_table(cfg.model, dense.model, verdict, dense_verdict, shares[cfg.name], shares[dense.name])
    print(f"\n{table.title}\n\n{table.to_markdown()}")
    with open(report, "a") as f:
        f.write(f"\n## {table.title}\n\n{table.to_markdown()}\n\nThe dense counterpart's own report: "
                "dense-counterpart/report.md.\n")
    return {"dense_counterpart": {"config": dense.name, "model": dense.model.to_dict(), "layout": str(dense.layout),
                                  **dense_verdict.to_json()},
            "active_parameters": cfg.model.active_parameters(), "parameters": cfg.model.parameters(),
            "attention_share": {"moe": share_summary(shares[cfg.name]), "dense": share_summary(shares[dense.name])}}
