"""What the subcommands share, so that no subcommand imports another.

- checks: bad paths and numbers fail at once in one line naming the flag and the value, before any
  work is done (``output_file``, ``input_file``, ``positive``, ``cost_profile``, ...);
- length streams: ``--lengths`` / ``--data-prefix`` options and readers (``add_stream_args``,
  ``open_stream``, ``corpus_sample``, ``resolve_lengths``); an indexed corpus (``--data-prefix`` /
  ``--data-path``) is read by the training reader (``data.reader``): memory-mapped, lazily, with the
  ``.bin`` size and pointer checks training makes;
- running: the progress bar (``tqdm_progress``, a ``sim.iteration.Progress``), ``run_packer`` and
  the benchmark's ``machine`` line.

Package modules are imported at the top (the cli sits above every layer, so no cycle can arise); the optional
tqdm is imported where used.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

import numpy as np

from megatron_wlb.config import RunConfig
from megatron_wlb.costmodel import PROFILE_FORMAT, load_profile
from megatron_wlb.data import load_lengths, stdlib_lengths
from megatron_wlb.data.blend import DEFAULT_SEED
from megatron_wlb.data.reader import DocumentReader, IndexedSource, weighted_prefixes
from megatron_wlb.packing import GlobalBatch, Packer
from megatron_wlb.packing.base import ArraySource, StreamSource

_T = TypeVar("_T")


def output_file(path: str | Path, flag: str = "--out") -> Path:
    """``path`` as a file to write: not a directory, its parent creatable."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag} {p} is a directory; give a file name")
    parent = p.parent
    if parent.exists() and not parent.is_dir():
        raise ValueError(f"{flag} {p}: {parent} is a file, not a directory")
    parent.mkdir(parents=True, exist_ok=True)
    return p


def output_dir(path: str | Path, flag: str = "--out") -> Path:
    """``path`` as a directory to write into (created), not an existing file."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{flag} {p} is an existing file; give a directory")
    p.mkdir(parents=True, exist_ok=True)
    return p


def input_file(path: str | Path, flag: str) -> Path:
    """``path`` as an existing regular file to read."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{flag} {p} does not exist")
    if not p.is_file():
        raise ValueError(f"{flag} {p} is a directory, not a file")
    return p


def read_json_object(path: str | Path, flag: str) -> dict[str, Any]:
    """The JSON object in ``path``; a list, a syntax error or binary data is a one-line error."""
    p = input_file(path, flag)
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{flag} {p}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{flag} {p}: expected a JSON object with a \"format\" field, got a {type(data).__name__}")
    return data


def positive(value: int, flag: str, maximum: int | None = None) -> int:
    """``value`` if it is an integer >= 1 (and <= ``maximum``), else a one-line error."""
    if value < 1 or (maximum is not None and value > maximum):
        valid = f"1 .. {maximum}" if maximum is not None else "a positive integer"
        raise ValueError(f"{flag} {value}: must be {valid}")
    return value


def show_progress() -> bool:
    """Progress bars only on a terminal: in a log file they are noise."""
    return sys.stderr.isatty()


def cost_profile(path: str | Path | None, flag: str = "--cost-profile", config: RunConfig | None = None) -> str | None:
    """``path`` (else ``config``'s ``cost.profile``, if any) after checking it is a ``megatron-wlb-profile/1``
    file the cost model can read."""
    if path is None and config is not None and config.cost.profile is not None:
        path, flag = config.cost.profile, f"{config.name}: cost.profile"
    if path is None:
        return None

    fmt = read_json_object(path, flag).get("format")
    if fmt != PROFILE_FORMAT:
        raise ValueError(f"{flag} {path}: format {fmt!r}, expected {PROFILE_FORMAT!r} (a cost-model profile "
                         "written by `wlb calibrate`)")
    try:
        load_profile(path)
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{flag} {path}: malformed profile ({type(exc).__name__}: {exc})") from None
    return str(path)


def with_virtual_stages(config: RunConfig, virtual_stages: int | None, flag: str = "--virtual-stages") -> RunConfig:
    """``config`` with ``--virtual-stages`` applied (None: unchanged); a one-line error if the pipeline
    cannot interleave that many."""
    if virtual_stages is None:
        return config
    if virtual_stages < 1 or (virtual_stages > 1 and config.micro_batches % config.layout.pp):
        raise ValueError(f"{flag} {virtual_stages}: needs >= 1 and micro_batches ({config.micro_batches}) "
                         f"divisible by pp ({config.layout.pp})")
    return config.with_virtual_stages(virtual_stages)


def seeds_from(first: int, count: int, flag: str = "--seed") -> list[int]:
    """``count`` consecutive shuffle seeds from ``first``, each a valid numpy ``RandomState`` seed."""
    if first < 0 or first + count - 1 >= 2**32:
        raise ValueError(f"{flag} {first}: must be 0 .. {2**32 - count} (numpy RandomState seeds, "
                         f"{count} consecutive ones)")
    return [first + k for k in range(count)]


# -- what the packing metrics mean -------------------------------------------------------------------
#: Unit and meaning of every metric ``wlb pack`` prints (``PackingMetrics`` and the packers'
#: ``diagnostics()``); ``wlb pack --help`` lists them and ``wlb bench`` names its columns from them.
#: "budget" = the tokens one iteration trains, DP x N x seq_len.
METRIC_LEGEND: dict[str, tuple[str, str]] = {
    "packer": ("", "the packer that made the plan"),
    "config": ("", "the run config (layout, seq_len, N micro-batches per DP rank)"),
    "lengths": ("", "the length stream packed"),
    "schedule": ("", "the pipeline schedule of schedule_ratio and the packer's dealing (the config's)"),
    "documents_read": ("documents", "documents the packer read from the stream"),
    "dropped": ("documents", "documents dropped (always 0: none is dropped, duplicated or cut silently)"),
    "iterations": ("global batches", "iterations packed"),
    "imbalance": ("ratio, 1 = balanced", "paper Table 2: max micro-batch fwd+bwd latency x N / sum, per DP rank, "
                                         "mean over ranks and iterations"),
    "imbalance_fwd": ("ratio, 1 = balanced", "the same from forward latency only (the paper's own definition)"),
    "imbalance_max": ("ratio, 1 = balanced", "the worst DP rank and iteration of imbalance"),
    "imbalance_global": ("ratio, 1 = balanced", "max / mean over all DP x N micro-batches, mean over iterations"),
    "unused_capacity": ("fraction", "1 - tokens / sum of micro-batch capacities (wlb's capacity is S_max)"),
    "fill_vs_seq_len": ("fraction of the budget", "tokens / (budget x iterations): the stream rate kept"),
    "mean_delay": ("iterations per token", "how long a token waits past its arrival iteration (positive part), "
                                           "token-weighted"),
    "max_delay": ("iterations", "the longest wait of any piece"),
    "mean_reorder": ("iterations per token", "|emitted - arrival| token-weighted (window packers also read ahead)"),
    "plan_ms_mean": ("ms per global batch", "wall-clock planning time (window packers: amortised over the window)"),
    "plan_ms_max": ("ms", "the slowest global batch's planning time"),
    "plan_cpu_ms_mean": ("ms per global batch", "CPU time of the planning thread (wall time includes waiting "
                                                "for a core)"),
    "plan_cpu_ms_max": ("ms", "the largest CPU time of one global batch"),
    "tokens": ("tokens", "tokens emitted into the plan"),
    "schedule_ratio": ("ratio, 1 = balanced", "the slowest DP rank's pipeline time / the same with every "
                                              "micro-batch at the mean, summed over iterations (what the job "
                                              "waits for), under the schedule named above"),
    "schedule_ratio_max": ("ratio, 1 = balanced", "the worst iteration of schedule_ratio"),
    "schedule_floor": ("ratio, 1 = balanced", "schedule_ratio of the best balance the plan's own pieces allow "
                                              "while each stays whole: schedule_ratio - schedule_floor is what "
                                              "packing loses; schedule_floor - 1 belongs to pieces heavier than "
                                              "a balanced micro-batch (only cutting them removes it)"),
    "min_fill": ("fraction of the budget", "the emptiest iteration's tokens / budget, over every iteration "
                                           "packed, including the last ones that drain the packer after the "
                                           "stream ends; the README's 'min fill >= 0.50' is over iterations "
                                           "while documents wait (its benchmark never reaches the stream's "
                                           "end; `wlb pack --iterations K` leaves the drain out)"),
    "fill_p5": ("fraction of the budget", "5th percentile over the iterations of tokens / budget"),
    "fill_p50": ("fraction of the budget", "median over the iterations of tokens / budget"),
    "fill_p95": ("fraction of the budget", "95th percentile over the iterations of tokens / budget"),
    "pairs_per_token": ("pairs per token", "causal attention (query, key) pairs per token, sum of d (d + 1) / 2 "
                                           "over the pieces / tokens: the attention work the pieces imply"),
    "low_fill_iterations": ("iterations", "iterations below half the budget (the final drain included)"),
    "thresholds": ("tokens", "the outlier queues' lower bounds L_1 < L_2 ... (auto: derived from the stream)"),
    "forced_splits": ("pieces", "outliers at max_delay that fit no micro-batch whole and were split to keep "
                                "the bound"),
    "fill_releases": ("pieces", "outliers released early so that no iteration falls below the fill rule"),
    "cut_stats": ("", "what the cut policy cut: cut points made, tokens of the cut "
                                               "documents, pieces they became"),
    "delay_overruns": ("pieces", "forced pieces that fit nowhere whole and were not cut (waited past max_delay)"),
    "read_ahead_tokens": ("tokens", "tokens read ahead of the budget to fill iterations that outliers left "
                                    "room in"),
    "balanced_releases": ("pieces", "queued outliers released because the iteration could balance them"),
    "solver_status": ("", "HiGHS status: windows solved with each"),
    "skipped_windows": ("windows", "windows over the solver's column cap (the greedy plan kept)"),
}


def metric_line(key: str, value: Any) -> str:
    """``key: value unit  # meaning`` for one printed metric (``METRIC_LEGEND``)."""
    unit, meaning = METRIC_LEGEND.get(key, ("", ""))
    shown = round(value, 4) if isinstance(value, float) else value
    text = f"{key:>19}: {shown}" + (f" {unit}" if unit and not unit.startswith("ratio") else "")
    if unit.startswith("ratio"):
        text += f" ({unit})"
    return f"{text:<44}  # {meaning}" if meaning else text


def legend_text(keys: Iterable[str] | None = None) -> str:
    """The legend (``key [unit]: meaning``, one a line) of ``keys`` (default: every metric)."""
    lines = []
    for key in (keys if keys is not None else METRIC_LEGEND):
        unit, meaning = METRIC_LEGEND[key]
        lines.append(f"  {key}{f' [{unit}]' if unit else ''}: {meaning}")
    return "\n".join(lines)


# -- length streams ------------------------------------------------------------------------------------
#: a length-stream name that stands for an indexed dataset (``--data-prefix``)
DATA_PREFIX_SCHEME = "prefix:"
#: a length-stream name that stands for a Megatron ``--data-path`` blend (shuffled as Megatron does)
DATA_PATH_SCHEME = "data-path:"


def data_path_stream(tokens: Sequence[str]) -> str:
    """The stream name of a ``--data-path`` blend: ``data-path:W1 P1 W2 P2``, each token shell-quoted where it
    needs it (a prefix with a space stays one token); ``data_path_tokens`` reads it back."""
    return DATA_PATH_SCHEME + shlex.join(tokens)


def data_path_tokens(source: str) -> list[str]:
    """The ``--data-path`` tokens of a ``data-path:...`` stream name (shell words: quote a prefix holding a space)."""
    try:
        return shlex.split(source[len(DATA_PATH_SCHEME):])
    except ValueError as exc:
        raise ValueError(f"length stream {source!r}: {exc}; quote a prefix holding a space or a quote "
                         "('data-path:1 \"/my data/a\"')") from None


def add_stream_args(parser: argparse.ArgumentParser, required: bool = False) -> argparse._MutuallyExclusiveGroup:
    """Add ``--lengths`` / ``--data-prefix`` as a mutually exclusive group; return the group."""
    group = parser.add_mutually_exclusive_group(required=required)
    group.add_argument("--lengths", metavar="FILE",
                       help="document lengths: .json / .npy / text, one per line ('wlbllm' = the embedded "
                            "stand-in distribution, published by the DistCA authors)")
    group.add_argument("--data-prefix", metavar="PREFIX",
                       help="a Megatron indexed dataset PREFIX (PREFIX.idx/.bin, read as training reads them)")
    return group


def add_cache_arg(parser: argparse.ArgumentParser) -> None:
    """``--data-cache-path``: accepted as the job's (the reader's epoch order is a keyed permutation: nothing is
    cached; an older numpy order would build its files there)."""
    parser.add_argument("--data-cache-path", default=None, metavar="DIR",
                        help="with --data-path: your job's --data-cache-path (the epoch order is a keyed "
                             "permutation evaluated per block: nothing is built or cached there)")


def corpus_reader(source: str, cache: str | None = None) -> DocumentReader:
    """The training reader (``data.reader.DocumentReader``) over a ``prefix:PREFIX`` or ``data-path:...``
    stream, the whole corpus (``--split 1,0,0``): memory-mapped and checked as training checks it (the
    ``.bin`` size, the pointers; one-line errors naming the flag). A prefix is read in file order; a
    ``--data-path`` is shuffled and blended as wlb's training reader does with ``--seed`` 1234 (unweighted
    prefixes weigh the same), its epoch orders in ``cache`` when given (``--data-cache-path``)."""

    if source.startswith(DATA_PREFIX_SCHEME):
        prefix = source[len(DATA_PREFIX_SCHEME):]
        return DocumentReader([(IndexedSource.open(prefix, flag="--data-prefix"), 1.0)], split="1,0,0",
                              shuffle=False)
    if not source.startswith(DATA_PATH_SCHEME):
        raise ValueError(f"length stream {source!r} is not an indexed corpus ({DATA_PREFIX_SCHEME}PREFIX or "
                         f"{DATA_PATH_SCHEME}...)")
    parts = weighted_prefixes(data_path_tokens(source))
    return DocumentReader([(IndexedSource.open(prefix, flag="--data-path"), w) for prefix, w in parts],
                          split="1,0,0", seed=DEFAULT_SEED, shuffle=True, order_cache=cache)


class LengthStream:
    """A length stream as the packers read it: an array (``--lengths``, the embedded one), or an indexed
    corpus read lazily through the training reader (``corpus_reader``): a packer then holds a moving window
    of the stream and views of the ``.idx``, not a per-document array of the corpus."""

    def __init__(self, name: str, lengths: np.ndarray | None = None, reader: DocumentReader | None = None):
        self.name, self._lengths, self.reader = name, lengths, reader
        self._tokens: int | None = None

    @property
    def documents(self) -> int:
        """Documents of the corpus (an array: its length)."""
        return int(self.reader.num_documents) if self.reader is not None else int(self._array().size)

    @property
    def tokens(self) -> int:
        """Virtual time of one pass over the corpus (``DocumentReader.epoch_tokens``; an array: its tokens)."""
        if self._tokens is None:
            self._tokens = (self.reader.epoch_tokens() if self.reader is not None else int(self._array().sum()))
        return self._tokens

    def _array(self) -> np.ndarray:
        if self._lengths is None:
            assert self.reader is not None
            self._lengths = self.reader.stream(self.tokens).collect()[1]
        return self._lengths

    def lengths(self) -> np.ndarray:
        """The lengths of one pass, materialised (small streams, or callers that need the array)."""
        return self._array()

    def source(self, min_tokens: int = 0, seed: int = 0) -> StreamSource:
        """A fresh ``StreamSource`` of the stream (each packer reads its own): one lazy pass over a corpus that
        holds ``min_tokens``; else the pass materialised and repeated (``repeat_stream``) until it does."""
        if self.reader is not None and self._lengths is None and self.tokens >= min_tokens:
            return self.reader.stream(self.tokens).cursor()
        lengths = repeat_stream(self._array(), min_tokens, seed)
        return ArraySource(lengths, np.arange(lengths.size, dtype=np.int64))


def open_stream(source: str, cache: str | None = None) -> LengthStream:
    """The stream named as ``resolve_lengths`` takes it, checked now (a missing file, a damaged corpus or an
    empty stream is a one-line error naming it); an indexed corpus stays lazy (``LengthStream``)."""
    if source.startswith((DATA_PREFIX_SCHEME, DATA_PATH_SCHEME)):
        return LengthStream(source, reader=corpus_reader(source, cache))
    return LengthStream(source, lengths=read_stream(source))


def corpus_sample(prefixes: Sequence[str], flag: str, max_documents: int | None,
                  seed: int) -> tuple[list[np.ndarray], int, int]:
    """(per dataset its document lengths in file order, documents read, documents in the corpus), each
    dataset opened by the training reader (``IndexedSource``: mapped, checked). All documents when the corpus
    holds at most ``max_documents`` (None: no cap); else the same share of each dataset, drawn uniformly
    without replacement (``IndexedSource.sample_lengths``, seeded): only those ``.idx`` entries are read."""

    sources = [IndexedSource.open(prefix, flag=flag) for prefix in prefixes]
    total = sum(src.num_documents for src in sources)
    if max_documents is None or total <= max_documents:
        datasets = [src.sample_lengths() for src in sources]
    else:
        share = max_documents / total
        datasets = [src.sample_lengths(max(1, round(share * src.num_documents)), seed + 7919 * i)
                    for i, src in enumerate(sources)]
    return datasets, int(sum(d.size for d in datasets)), int(total)


def load_stream(args: argparse.Namespace) -> tuple[np.ndarray, str]:
    """(lengths, description) from --lengths / --data-prefix (the whole corpus, read by the training
    reader: checked, then materialised; ``wlb simulate`` / ``reproduce``), the embedded stream by default."""

    if getattr(args, "data_prefix", None):
        lengths = corpus_sample([args.data_prefix], "--data-prefix", None, 0)[0][0]
        return lengths, f"{args.data_prefix}.idx ({lengths.size:,} documents)"
    if getattr(args, "lengths", None):
        lengths = load_lengths(args.lengths)
        name = "embedded dist_wlbllm.json (DistCA authors' stand-in)" if args.lengths == "wlbllm" else args.lengths
        return lengths, f"{name} ({lengths.size:,} documents)"
    lengths = load_lengths()
    return lengths, (f"embedded dist_wlbllm.json ({lengths.size:,} documents; a stand-in for the paper's "
                     "data published by the DistCA authors, github hao-ai-lab/DistCA)")


def read_stream(source: str) -> np.ndarray:
    """The lengths of a stream named as ``resolve_lengths`` takes it, once (a missing file or an empty
    stream is a one-line error naming it); an indexed corpus is read by the training reader
    (``corpus_reader``) and materialised."""

    if source == "stdlib":
        base = stdlib_lengths()
    elif source.startswith((DATA_PREFIX_SCHEME, DATA_PATH_SCHEME)):
        base = open_stream(source).lengths()
    else:
        base = load_lengths(source)
    if base.size == 0:
        raise ValueError(f"length stream {source!r} is empty")
    return base


def repeat_stream(base: np.ndarray, min_tokens: int = 0, seed: int = 0) -> np.ndarray:
    """``base`` repeated (a seeded shuffle per extra pass) until it holds at least ``min_tokens`` tokens."""
    parts, total = [base], int(base.sum())
    rng = np.random.default_rng(seed)
    while total < min_tokens:
        parts.append(base[rng.permutation(base.size)])
        total += int(base.sum())
    return np.concatenate(parts)


def resolve_lengths(source: str, min_tokens: int = 0, seed: int = 0) -> np.ndarray:
    """Lengths from a file, 'wlbllm', 'stdlib', ``prefix:PREFIX`` (an indexed dataset) or
    ``data-path:W1 P1 W2 P2`` (a blend); repeated (a seeded shuffle per extra pass) until they hold
    at least ``min_tokens`` tokens, so short streams can fill long benchmarks."""
    return repeat_stream(read_stream(source), min_tokens, seed)


# -- running ------------------------------------------------------------------------------------------
def tqdm_progress(items: Iterable[_T], desc: str, total: int | None) -> Iterable[_T]:
    """A progress bar on stderr (hidden when stderr is not a terminal): a ``sim.iteration.Progress``."""
    from tqdm import tqdm

    return tqdm(items, desc=desc, total=total, file=sys.stderr, leave=False, disable=None)


def run_packer(packer: Packer, lengths: np.ndarray | StreamSource, iterations: int | None,
               progress: str | None = None, out: IO[str] | None = None) -> list[GlobalBatch]:
    """Pack ``lengths`` (an array, or a ``StreamSource`` such as ``LengthStream.source()``; up to
    ``iterations`` global batches), with a progress bar named ``progress``
    on a terminal; ``out`` gets one JSON line per global batch (``wlb pack --out``).

    Python's cyclic garbage collector is paused while packing: plans hold no reference cycles
    (refcounting frees them), but every plan is kept here for the metrics, and a full collection
    over those ~10^5..10^6 live objects would add a 100+ ms pause to whichever batch it hits, an
    artefact of keeping the whole run in memory that a training loop does not have.
    """
    import gc

    from tqdm import tqdm

    batches: list[GlobalBatch] = []
    bar = tqdm(total=iterations, desc=progress, file=sys.stderr, disable=progress is None or not show_progress(),
               leave=False)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        batches_of = packer.pack(lengths) if isinstance(lengths, np.ndarray) else packer.pack_source(lengths)
        for batch in batches_of:
            batches.append(batch)
            if out is not None:
                out.write(json.dumps({"iteration": batch.iteration, "micro_batches": [
                    [[p.doc_id, p.offset, p.length] for p in mb.pieces] for mb in batch.micro_batches]}) + "\n")
            bar.update(1)
            if iterations is not None and len(batches) >= iterations:
                break
    finally:
        if was_enabled:
            gc.enable()
        bar.close()
    return batches
