"""The measured-execution trace: one row per micro-batch per rank and model chunk, as JSON lines.

Written by the Megatron adapter (``megatron_wlb.megatron.state.timing``, ``--wlb-trace PATH``), read by
``wlb calibrate --from-trace`` and ``benchmarks/bench_measured.py``. Pure: no torch, no Megatron.

Every rank writes its own file, ``trace_path_for_rank(PATH, rank)`` (``trace.jsonl`` ->
``trace-rank00003.jsonl``); ``read_trace(PATH)`` reads the file itself if it exists, else every
rank's file. Each file starts with one ``header`` row, then per iteration the ``micro_batch`` rows
of that rank and one ``iteration`` row::

    {"kind": "header", "format": TRACE_FORMAT, "rank": 0, "device": "...", "clock": "cpu"|"cpu-thread"|"cuda",
     "model": ModelShape fields, "layout": {"tp", "cp", "pp", "dp", "vpp"}, "n": micro-batches per DP rank
     and iteration, "cost_model": "...",
     "settings": {...}}
    {"kind": "micro_batch", "iteration": 3, "rank": 0, "dp": 0, "pp": 0, "cp": 0, "tp": 0, "chunk": 0,
     "micro_batch": 1, "layers": 2, "tokens": 1024, "sum_d2": 3.1e5, "lengths": [...],
     "rank_tokens": 512, "rank_pairs": 8.1e4, "rank_runs": 7, "pred_fwd_s": ..., "pred_bwd_s": ...,
     "fwd_s": ..., "bwd_s": ..., "data_s": ..., "wait_fwd_s": ..., "wait_bwd_s": ..., "group": 2}
    {"kind": "iteration", "iteration": 3, "rank": 0, "dp": 0, "pp": 0, "cp": 0, "tp": 0,
     "wall_s": ..., "compute_s": ..., "pp_wait_s": ..., "dp_wait_s": ..., "timing_s": ..., "micro_batches": 4}
    {"kind": "refit", "iteration": 9, "state": {...}}     (--wlb-cost-model online: each refit's model)

Field meanings (seconds are measured on this rank: a monotonic clock on the CPU, CUDA events on a GPU):

- ``tokens`` / ``sum_d2`` / ``lengths``: the whole micro-batch as planned (every CP rank's tokens, the
  pieces' lengths); ``rank_tokens`` / ``rank_pairs`` / ``rank_runs``: this CP rank's query rows, the
  causal (query, key) pairs its attention computes and its query runs (documents or their pieces on
  this rank; ``cp.layouts.RankShard``), what its time depends on;
- ``layers``: transformer layers in this model chunk (the fit divides by it: profiles are per layer);
- ``group``: the CP ranks of the micro-batch's group (the run's CP size, or under dynamic CP its group's);
- ``pred_fwd_s`` / ``pred_bwd_s``: the run's cost model for this rank's share as laid out (its own query runs,
  tokens and pairs, ``packing.metrics.share_seconds``), times ``layers`` (under
  ``--wlb-cp-sharding dynamic``: at the CP size of the micro-batch's group, as its dynamic-CP plan priced it;
  ``tokens`` / ``lengths`` are then the group's micro-batch, an empty one has none, and a micro-batch row's
  ``cp`` is the rank's place in that group);
- ``fwd_s`` / ``bwd_s``: the chunk's forward / backward step (Megatron's ``forward_step`` /
  ``backward_step``: embedding and loss included on the first / last stage);
- ``data_s``: host seconds the forward step spent in our data iterator (planning the iteration on its
  first micro-batch, reading and laying out the tokens), inside ``fwd_s`` on the CPU clock;
- ``wait_fwd_s`` / ``wait_bwd_s``: seconds in pipeline sends/receives since this rank's previous
  step, i.e. what this step waited for;
- ``wall_s``: the rank's forward-backward pass (first step start to the gradient reduction's end);
  ``compute_s``: the sum of its steps; ``pp_wait_s``: pipeline send/receive seconds; ``dp_wait_s``:
  Megatron's ``finalize_model_grads`` (the DP gradient reduction, waiting for the slowest rank);
  ``timing_s``: host seconds the timing itself took since the previous pass (its hooks, the trace
  flush, the measuring all-reduces): its overhead;
- a ``refit`` row: the state of a refitted cost model (``costmodel.refit.cost_state``) and the
  iteration whose log refitted it.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

TRACE_FORMAT = "megatron-wlb-trace/1"


@dataclass(frozen=True)
class RankRow:
    """What every row starts with: the iteration (the plan's, 0-based) and the rank's place in the layout."""

    iteration: int
    rank: int
    dp: int
    pp: int
    cp: int
    tp: int


@dataclass(frozen=True)
class MicroBatchRow(RankRow):
    """One micro-batch's forward and backward on one rank and model chunk (see the module docstring)."""

    chunk: int
    micro_batch: int
    layers: int
    tokens: int
    sum_d2: float
    lengths: tuple[int, ...]
    rank_tokens: int
    rank_pairs: float
    rank_runs: int
    pred_fwd_s: float
    pred_bwd_s: float
    fwd_s: float
    bwd_s: float
    data_s: float
    wait_fwd_s: float
    wait_bwd_s: float
    #: CP ranks of the micro-batch's group (the run's CP size; under dynamic CP its group's); 0: not recorded (a
    #: trace written before the field), read as the header's CP size
    group: int = 0
    #: this rank's query runs: each one's queries and keys (``cp.layouts.RankShard``), what its attention computes
    #: run by run; (): not recorded (a trace written before the fields)
    run_q: tuple[int, ...] = ()
    run_kv: tuple[int, ...] = ()

    kind = "micro_batch"

    @property
    def measured_s(self) -> float:
        return self.fwd_s + self.bwd_s

    @property
    def predicted_s(self) -> float:
        return self.pred_fwd_s + self.pred_bwd_s


@dataclass(frozen=True)
class IterationRow(RankRow):
    """One rank's forward-backward pass of one iteration (see the module docstring)."""

    wall_s: float
    compute_s: float
    pp_wait_s: float
    dp_wait_s: float
    timing_s: float
    micro_batches: int

    kind = "iteration"


@dataclass(frozen=True)
class Trace:
    """Every rank's rows of one run: headers (one per rank file), micro-batch and iteration rows."""

    headers: tuple[dict[str, Any], ...]
    micro_batches: tuple[MicroBatchRow, ...]
    iterations: tuple[IterationRow, ...]
    refits: tuple[dict[str, Any], ...] = ()

    def after_warmup(self, warmup: int) -> Trace:
        """The rows of iterations ``>= warmup`` (0-based plan iterations)."""
        return Trace(self.headers, tuple(r for r in self.micro_batches if r.iteration >= warmup),
                     tuple(r for r in self.iterations if r.iteration >= warmup), self.refits)


def row_to_json(row: MicroBatchRow | IterationRow) -> str:
    """One JSON line (``kind`` first)."""
    out: dict[str, Any] = {"kind": row.kind, **asdict(row)}
    if isinstance(row, MicroBatchRow):
        for key in ("lengths", "run_q", "run_kv"):
            out[key] = list(getattr(row, key))
    return json.dumps(out, separators=(",", ":"))


def trace_path_for_rank(path: str | os.PathLike[str], rank: int) -> Path:
    """Rank ``rank``'s file of the trace ``path``: ``trace.jsonl`` -> ``trace-rank00003.jsonl``."""
    p = Path(path)
    return p.with_name(f"{p.stem}-rank{rank:05d}{p.suffix}")


def trace_files(path: str | os.PathLike[str]) -> list[Path]:
    """The files of the trace ``path``: the file itself if it exists, else every rank's file."""
    p = Path(path)
    if p.is_file():
        return [p]
    files = sorted(Path(f) for f in glob.glob(str(p.with_name(f"{glob.escape(p.stem)}-rank[0-9]*{p.suffix}"))))
    if not files:
        raise ValueError(f"{path}: no trace there (expected the file or its per-rank files "
                         f"{trace_path_for_rank(p, 0).name}, ...); write one with --wlb-trace {path}")
    return files


#: micro-batch fields a row may lack (written before them): their defaults
_MB_OPTIONAL = {f.name for f in fields(MicroBatchRow) if f.default is not MISSING}
_MB_FIELDS = {f.name for f in fields(MicroBatchRow)} - _MB_OPTIONAL
_IT_FIELDS = {f.name for f in fields(IterationRow)}


def _rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not a JSON line ({exc.msg})") from None
            if not isinstance(row, dict) or "kind" not in row:
                raise ValueError(f"{path}:{number}: expected an object with a 'kind' "
                                 "(header, micro_batch or iteration)")
            yield number, row


def read_trace(paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> Trace:
    """Every row of a trace (one path, its per-rank files, or several paths); raises ValueError naming
    the file and line of a malformed row."""
    if isinstance(paths, (str, os.PathLike)):
        files = trace_files(paths)
    else:
        files = [f for p in paths for f in trace_files(p)]
    headers: list[dict[str, Any]] = []
    mbs: list[MicroBatchRow] = []
    its: list[IterationRow] = []
    refits: list[dict[str, Any]] = []
    for path in files:
        for number, row in _rows(path):
            kind = row["kind"]
            if kind == "refit":
                refits.append(row)
                continue
            if kind == "header":
                if row.get("format") != TRACE_FORMAT:
                    raise ValueError(f"{path}:{number}: trace format {row.get('format')!r}, expected "
                                     f"{TRACE_FORMAT!r}")
                headers.append(row)
                continue
            wanted = {"micro_batch": _MB_FIELDS, "iteration": _IT_FIELDS}.get(kind)
            if wanted is None:
                raise ValueError(f"{path}:{number}: unknown row kind {kind!r}; valid: header, micro_batch, iteration, "
                                 "refit")
            missing = wanted - set(row)
            if missing:
                raise ValueError(f"{path}:{number}: {kind} row lacks {', '.join(sorted(missing))}")
            values = {k: row[k] for k in wanted}
            if kind == "micro_batch":
                values.update({k: row[k] for k in _MB_OPTIONAL if k in row})
                for key in ("lengths", "run_q", "run_kv"):
                    values[key] = tuple(int(x) for x in values.get(key, ()))
                mbs.append(MicroBatchRow(**values))
            else:
                its.append(IterationRow(**values))
    if not headers:
        raise ValueError(f"{', '.join(map(str, files))}: no header row: not a megatron-wlb trace")
    return Trace(tuple(headers), tuple(mbs), tuple(its), tuple(refits))


# -- the cost-model profile from a trace (``wlb calibrate --from-trace``) ---------------------------------
def trace_setup(trace: Trace) -> dict[str, Any]:
    """``{"model", "layout", "device"}`` of the traced run, from its headers; a one-line error when the
    rank files disagree (files of two runs under one name) or a header lacks them."""
    first = trace.headers[0]
    wanted = {"model": "ModelShape fields (a run without a cost model records none)", "layout": "tp, cp, pp, dp, vpp"}
    for key in ("model", "layout"):
        if not isinstance(first.get(key), dict):
            raise ValueError(f"trace header of rank {first.get('rank')}: {key} {first.get(key)!r}: expected a mapping "
                             f"of {wanted[key]}")
        for other in trace.headers[1:]:
            if other.get(key) != first[key]:
                raise ValueError(f"trace headers disagree on {key}: rank {first.get('rank')} {first[key]}, rank "
                                 f"{other.get('rank')} {other.get(key)} (files of two runs under one name?)")
    return {"model": first["model"], "layout": first["layout"], "device": str(first.get("device", "unknown"))}


def trace_packing(trace: Trace) -> str:
    """The packing a traced run's plans came from, from its header's settings: the packer, with its pieces
    when not whole documents and its CP sharding when CP > 1 (e.g. ``wlb``, ``wlb, concat-and-cut``): the
    label ``wlb calibrate --from-trace`` holds each trace's points out by."""
    first = trace.headers[0]
    settings = first.get("settings") or {}
    parts = [str(settings.get("packer", "unknown"))]
    if settings.get("pieces", "documents") != "documents":
        parts.append(str(settings["pieces"]))
    if int((first.get("layout") or {}).get("cp", 1)) > 1:
        parts.append(str(settings.get("cp_sharding", "")))
    return ", ".join(parts)


def profile_points(rows: Iterable[MicroBatchRow], layout: dict[str, Any], clock: str = "cpu") -> dict[str, list[Any]]:
    """The ``micro_batches`` section of a cost-model profile (``costmodel.load_profile``), one point per row
    with positive times and tokens: this CP rank's ``rank_pairs``, ``rank_tokens`` and ``rank_runs``, its
    ``fwd_s`` and ``bwd_s`` divided by ``layers`` (a profile is per layer), and ``iteration`` (for the
    held-out split). On the CPU clock (``clock``, the trace header's) the forward leaves out ``data_s``,
    the host time our data iterator took inside it: the model's work, not the data path's (on the thread
    clock, ``WLB_TRACE_CLOCK=thread``, too: ``data_s`` is the iterator's wall, ~its thread time).

    ``head_tokens`` is ``rank_tokens / layers`` on the chunk that runs the LM head and loss (the last chunk
    of the last PP stage), else 0: the fit prices the head at ``head_ratio`` layers of GEMMs per token, as
    the simulator does, so a PP trace's last stage does not inflate every stage's per-token cost. The
    embedding (first chunk) is a lookup and stays in the per-layer coefficients.

    ``run_lengths`` / ``run_pairs``: each query run's length and causal pairs on this rank, for a fit that
    prices pairs by their run's length (``costmodel.table``): the row's own runs (``run_q``, ``run_kv``), exact.
    A row written before them: without CP the runs are the documents (``lengths``), exact; with CP each document
    stands as one run of ``length / cp`` queries holding its share of ``rank_pairs`` (in proportion to its
    whole-document pairs), an approximation.
    """
    last_pp, last_chunk = int(layout.get("pp", 1)) - 1, int(layout.get("vpp", 1) or 1) - 1
    run_cp = max(1, int(layout.get("cp", 1)))
    keys = ("pairs", "tokens", "runs", "head_tokens", "cp_calls", "cp_kv", "fwd_s", "bwd_s", "iteration", "rank")
    out: dict[str, list[Any]] = {k: [] for k in (*keys, "run_lengths", "run_pairs")}
    for r in rows:
        fwd = r.fwd_s - (r.data_s if clock in ("cpu", "cpu-thread") else 0.0)
        if r.layers < 1 or r.rank_tokens < 1 or r.tokens < 1 or not (fwd > 0 and r.bwd_s > 0):
            continue  # (a micro-batch of no document: ``empty_points``)
        cp = r.group or run_cp
        has_head = r.pp == last_pp and r.chunk == last_chunk
        out["pairs"].append(float(r.rank_pairs))
        out["tokens"].append(float(r.rank_tokens))
        out["runs"].append(float(r.rank_runs))
        out["head_tokens"].append(r.rank_tokens / r.layers if has_head else 0.0)
        out["cp_calls"].append(float(cp - 1))
        out["cp_kv"].append(r.tokens * (cp - 1) / cp)
        out["fwd_s"].append(fwd / r.layers)
        out["bwd_s"].append(r.bwd_s / r.layers)
        out["iteration"].append(r.iteration)
        out["rank"].append(r.rank)
        if r.run_q:  # the rank's own query runs, as its attention ran them
            out["run_lengths"].append(list(r.run_q))
            out["run_pairs"].append([q * kv - q * (q - 1) / 2.0 for q, kv in zip(r.run_q, r.run_kv)])
            continue
        whole = [d * (d + 1) / 2.0 for d in r.lengths]
        share = r.rank_pairs / sum(whole) if cp > 1 and sum(whole) > 0 else 1.0
        out["run_lengths"].append([d if cp == 1 else max(1, -(-d // cp)) for d in r.lengths])
        out["run_pairs"].append([p * share for p in whole])
    return out


def empty_points(rows: Iterable[MicroBatchRow], clock: str = "cpu") -> dict[str, list[float]]:
    """The ``empty_micro_batches`` section of a profile: the forward and backward seconds per layer of the rows of a
    micro-batch that holds no document (Megatron runs one all the same, of a padding token: a dynamic-CP slot done
    before its count), the data iterator's host time left out as ``profile_points`` leaves it out."""
    out: dict[str, list[float]] = {"fwd_s": [], "bwd_s": []}
    for r in rows:
        fwd = r.fwd_s - (r.data_s if clock in ("cpu", "cpu-thread") else 0.0)
        if r.layers >= 1 and r.tokens < 1 and fwd > 0 and r.bwd_s > 0:
            out["fwd_s"].append(fwd / r.layers)
            out["bwd_s"].append(r.bwd_s / r.layers)
    return out
