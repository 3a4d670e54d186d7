"""``wlb analyze --sft``: what balancing buys a fine-tuning job, against Megatron's SFT grouping and KK.

The conversations come from an SFT jsonl (``--sft-jsonl FILE --sft-tokenizer DIR``: tokenized by Megatron's
own ``SFTTokenizer``, a line's conversations kept together as ``SFTDataset`` keeps them), from ``--lengths``
(one conversation a line), or, with neither, from a synthetic heavy-tailed stream (log-normal, said in the
report). Megatron's grouping lays out the lines as ``SFTDataset`` does (as given, and prepacked: the jsonl
prepared for it); KK and the packer plan the documents ``--sft`` trains, cut from the lines by the training
path's own ``data.sft.line_documents`` under the config's ``sft.samples`` (``megatron``: each conversation's
segment of ``SFTDataset``'s sample of its line, CP padding included, cut and dropped as it cuts and drops;
``whole``: each conversation whole, cut only at the window), the mode and what it leaves out said in the report.
Compared at every ``--dp`` by ``sim.sft.compare_sft``; the table is printed and written to ``DIR/sft.md`` and
``DIR/sft.json``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from typing import Any

import numpy as np

from megatron_wlb.cli.common import output_dir
from megatron_wlb.config import load_config
from megatron_wlb.costmodel import build_cost_model
from megatron_wlb.data import load_lengths
from megatron_wlb.data.sft import (
    SAMPLES_MEGATRON,
    SftInputError,
    jsonl_line_lengths,
    planned_documents,
    samples_note,
)
from megatron_wlb.requirements import MissingDependency, missing_message, module_available
from megatron_wlb.sim.sft import compare_sft, lognormal_conversations, prepacked_lines, price_megatron

#: the synthetic stand-in: log-normal conversation lengths (median tokens, sigma), how many
SYNTHETIC_MEDIAN, SYNTHETIC_SIGMA, SYNTHETIC_COUNT = 1500, 1.3, 20000


def add_sft_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("fine-tuning (--sft)")
    g.add_argument("--sft", action="store_true",
                   help="compare balancing for SFT conversations: Megatron's SFTDataset grouping, KK by c*L + L^2 "
                        "(verl, slime) and the config's packer (--lengths: one conversation per line; none: a "
                        "synthetic log-normal stream)")
    g.add_argument("--sft-jsonl", metavar="FILE",
                   help="Megatron's SFT jsonl ({\"messages\": [...]} lines); implies --sft")
    g.add_argument("--sft-tokenizer", metavar="DIR", help="with --sft-jsonl: the tokenizer (--tokenizer-model)")
    g.add_argument("--sft-prompt-format", default="nemotron-h-aligned",
                   help="with --sft-jsonl: --sft-tokenizer-prompt-format (default nemotron-h-aligned)")
    g.add_argument("--dp", type=int, nargs="+", default=[4, 8], help="DP sizes to compare at (default 4 8)")


def megatron_sft_tokenizer(directory: str, prompt_format: str) -> Any:
    """Megatron's own tokenizer for ``--tokenizer-type SFTTokenizer`` (as its ``build_tokenizer`` makes it)."""
    if not module_available("transformers"):  # Megatron's SFTTokenizer loads the tokenizer with it
        raise MissingDependency(missing_message("transformers", "--sft-jsonl (Megatron's SFTTokenizer)"))
    try:
        from megatron.core.tokenizers import MegatronTokenizer
    except ImportError as exc:
        raise SftInputError(f"--sft-jsonl tokenizes with megatron-core's SFTTokenizer, which is not importable "
                            f"({exc}); pass the conversations' token counts as --lengths instead") from None
    return MegatronTokenizer.from_pretrained(tokenizer_path=directory, metadata_path={"library": "sft"},
                                             prompt_format=prompt_format)


def conversations(args: argparse.Namespace) -> tuple[list[list[int]], str]:
    """Lines of conversation lengths, and where they came from."""
    if args.sft_jsonl:
        if not args.sft_tokenizer:
            raise SftInputError("--sft-jsonl needs --sft-tokenizer DIR (the tokenizer the job's --tokenizer-model "
                                "names, with its chat template)")
        lines = jsonl_line_lengths(args.sft_jsonl, megatron_sft_tokenizer(args.sft_tokenizer, args.sft_prompt_format))
        return lines, f"{args.sft_jsonl} ({sum(map(len, lines)):,} conversations in {len(lines):,} lines)"
    if args.lengths:
        lengths = load_lengths(args.lengths)
        return [[int(x)] for x in lengths], f"{args.lengths} ({lengths.size:,} conversations, one a line)"
    lengths = lognormal_conversations(SYNTHETIC_COUNT, SYNTHETIC_MEDIAN, SYNTHETIC_SIGMA, seed=args.seed)
    return [[int(x)] for x in lengths], (
        f"synthetic: {lengths.size:,} log-normal conversation lengths (median {SYNTHETIC_MEDIAN}, sigma "
        f"{SYNTHETIC_SIGMA}, seed {args.seed}: p50 {int(np.percentile(lengths, 50)):,}, p90 "
        f"{int(np.percentile(lengths, 90)):,}, p99 {int(np.percentile(lengths, 99)):,}, max {int(lengths.max()):,} "
        "tokens); not fitted to a published corpus")


def run_sft(args: argparse.Namespace) -> int:
    """Print and write the comparison table."""
    cfg = load_config(args.config)
    out = output_dir(args.out)
    lines, source = conversations(args)
    flat = [n for line in lines for n in line]
    samples, cp = cfg.sft.samples, cfg.layout.cp
    documents, counts = planned_documents(lines, cfg.seq_len, samples, cp)
    where = args.sft_jsonl or args.lengths or "the synthetic stream"
    left_out = samples_note(where, cfg.seq_len, samples, counts) or "nothing cut or dropped"
    planned = (f"sft.samples {samples}: KK and {cfg.packer} plan {documents.size:,} documents ("
               + ("each conversation's segment of SFTDataset's sample of its line" if samples == SAMPLES_MEGATRON
                  else "each conversation whole") + f", seq_len {cfg.seq_len}, CP {cp}), as --sft trains them; "
               + left_out)
    rows = []
    for dp in args.dp:
        layout = replace(cfg.layout, dp=int(dp))
        packing = replace(cfg.packing, dp=int(dp))
        cost = build_cost_model(cfg.model, layout, profile=args.cost_profile)
        given = "the jsonl's lines" if args.sft_jsonl else "one conversation a line"
        methods = [(given, m) for m in compare_sft(lines, packing, cost, packer=cfg.packer, cp=layout.cp,
                                                  stages=layout.pp, virtual_stages=cfg.virtual_stages,
                                                  documents=documents)]
        prepacked = price_megatron(prepacked_lines(flat, cfg.seq_len, layout.cp), packing, cost, cp=layout.cp,
                                   stages=layout.pp, virtual_stages=cfg.virtual_stages)
        if prepacked is not None:
            methods.insert(1, ("prepacked lines", prepacked))
        ours = methods[-1][1]
        for shape, m in methods:
            rows.append({"dp": int(dp), "lines": shape, "method": m.name, "iterations": m.iterations,
                         "slowest_over_balanced": round(m.schedule_ratio, 4),
                         "tokens_per_s": round(m.tokens_per_second),
                         "ours_speedup": round(ours.tokens_per_second / m.tokens_per_second, 3),
                         "largest_micro_batch": m.largest_micro_batch})
    head = (f"# wlb analyze --sft: {cfg.name}, {cfg.model.name}, seq_len {cfg.seq_len}, layout {cfg.layout} "
            f"(DP varied), {cfg.packing.n} micro-batches per DP rank\n\nConversations: {source}.\n\n"
            f"Documents: {planned}.\n\n")
    table = ["| DP | lines | method | iterations | slowest rank / balanced | tokens/s (simulated) | "
             "ours' speedup over it | largest micro-batch |", "|---|---|---|---|---|---|---|---|"]
    table += [f"| {r['dp']} | {r['lines']} | {r['method']} | {r['iterations']} | {r['slowest_over_balanced']:.4f} | "
              f"{r['tokens_per_s']:,} | {r['ours_speedup']:.3f} | {r['largest_micro_batch']:,} |" for r in rows]
    text = head + "\n".join(table) + "\n"
    print(text)
    (out / "sft.md").write_text(text)
    (out / "sft.json").write_text(json.dumps({"config": cfg.name, "source": source, "samples": samples,
                                                      "documents": int(documents.size),
                                                      "counts": asdict(counts), "rows": rows}, indent=1))
    return 0
