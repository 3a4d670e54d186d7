"""Megatron-LM's own training loop on CPU (gloo): the entry point (the CUDA redirects: ``cpu_redirects``).

Megatron-LM is written for GPUs and calls CUDA unconditionally in a few places even when every tensor
could live on the CPU. ``install_cpu_redirects()`` points exactly those calls at the CPU, and nothing
else; each entry of ``REDIRECTS`` says which Megatron call needs it. The training step itself
(model, optimizer, pipeline schedules, our hooks) runs unchanged, on gloo process groups.

    torchrun --nproc-per-node 4 -m megatron_wlb.megatron.entry.cpu [--pretrain-gpt PATH] <Megatron + --wlb-* flags>

Without ``--pretrain-gpt`` the thin launcher ``megatron_wlb.megatron.entry.launcher`` runs (Megatron's
``pretrain`` from the installed megatron-core wheel, which ships ``megatron/training`` from 0.19 on);
with it, a Megatron-LM checkout's ``pretrain_gpt.py`` runs as ``__main__`` (the pinned, patched one).
``scripts/train_cpu.sh`` wraps this with a layout from environment variables.
"""

from __future__ import annotations

import os
import runpy
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from megatron_wlb.data.reader import (
    BYTE_EOD,
    VOCAB_SCAN_TOKENS,
    IndexedSource,
    byte_documents,
    weighted_prefixes,
    write_indexed_dataset,
)
from megatron_wlb.megatron.args.compat import spawn_children_import_this_module
from megatron_wlb.megatron.args.validation import exit_on_startup_error
from megatron_wlb.megatron.hooks import main_schedule

#: also here, imported on first use (``__getattr__``): REDIRECTS, install_cpu_redirects, install_megatron_redirects
__all__ = ["TINY_GPT_ARGS", "TINY_GPT_EOD", "layout_from_env", "main", "measurement_env", "pin_to_core",
           "tiny_gpt_vocab_flags", "write_text_corpus"]

#: A tiny GPT (2 layers, hidden 64, RoPE, RMSNorm, SwiGLU, GQA-free) with Megatron's local layer spec and
#: what the CPU needs: no fused CUDA kernels, CPU initialization, fp32, no gradient clipping (CUDA-only
#: multi-tensor kernels). Later flags override these (argparse keeps the last occurrence).
TINY_GPT_ARGS: tuple[str, ...] = (
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
    "--seq-length", "256", "--max-position-embeddings", "1024", "--micro-batch-size", "1",
    "--global-batch-size", "4", "--train-iters", "4", "--lr", "3e-3", "--min-lr", "3e-4",
    "--lr-decay-style", "constant", "--seed", "1234", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--no-persist-layer-norm",
    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-dropout-fusion",
    "--no-bias-swiglu-fusion", "--no-rope-fusion", "--transformer-impl", "local", "--use-cpu-initialization",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "300", "--split", "98,2,0", "--eval-iters", "0",
    "--eval-interval", "1000", "--clip-grad", "0", "--log-interval", "1", "--calculate-per-token-loss",
    "--distributed-backend", "gloo",
)

#: the end-of-document id of ``TINY_GPT_ARGS``'s NullTokenizer (vocabulary 300: its last id): a corpus for the
#: tiny GPT ends its documents with it, or Megatron's ``--reset-*`` masking finds no document ends
TINY_GPT_EOD = 299

#: the data-path flags whose prefixes the tiny GPT's vocabulary must cover
DATA_PATH_FLAGS = ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path")


def _flag_values(argv: Sequence[str], flag: str) -> list[list[str]]:
    """The values of every occurrence of ``flag`` (up to the next ``--`` flag)."""
    out = []
    for i, arg in enumerate(argv):
        if arg == flag:
            values = []
            for value in argv[i + 1:]:
                if value.startswith("--"):
                    break
                values.append(value)
            out.append(values)
    return out


def tiny_gpt_vocab_flags(argv: Sequence[str]) -> list[str]:
    """``--vocab-size`` for the tiny GPT from the data in ``argv``, reading no token it does not need: none when
    ``argv`` gives ``--vocab-size`` (the reader checks each dataset's first ``VOCAB_SCAN_TOKENS`` tokens at
    start-up and every token it reads: an id outside the vocabulary stops the run in one line when met) or when
    the ``.bin`` dtype cannot hold an id beyond the default (300); else the largest id in each dataset's first
    ``VOCAB_SCAN_TOKENS`` tokens + 1 where the default does not cover it (an id beyond that sample is refused
    when read, naming the ``--vocab-size`` that covers it)."""
    if "--sft" in argv:  # jsonl conversations: the SFT tokenizer sets the vocabulary
        return []
    given = _flag_values(argv, "--vocab-size")
    if given:
        vocab = given[-1][0] if given[-1] else ""
        if not vocab.isdigit() or int(vocab) < 1:
            raise SystemExit(f"megatron_wlb.megatron.entry.cpu: --vocab-size {vocab!r}: give a positive integer "
                             "(or leave it out: the tiny GPT takes it from the data)")
        return []
    default = int(TINY_GPT_ARGS[TINY_GPT_ARGS.index("--vocab-size") + 1])
    try:
        # argparse keeps a flag's last occurrence (train_cpu.sh puts its default --data-path first)
        prefixes = sorted({p for flag in DATA_PATH_FLAGS for values in _flag_values(argv, flag)[-1:] if values
                           for p, _ in weighted_prefixes(values)})
        top = -1
        for prefix in prefixes:
            source = IndexedSource.open(prefix)
            dtype = np.dtype(source.tokens.dtype)
            if np.issubdtype(dtype, np.integer) and np.iinfo(dtype).max < default:
                continue  # no id of this dtype is beyond the default vocabulary: nothing to read
            top = max(top, source.max_token_id(VOCAB_SCAN_TOKENS))
    except ValueError as exc:
        raise SystemExit(f"megatron_wlb.megatron.entry.cpu: {exc}") from None
    return [] if top < default else ["--vocab-size", str(top + 1)]


#: Environment variables that give the layout, and their defaults.
LAYOUT_VARIABLES = {"TP": 1, "CP": 1, "PP": 1, "VPP": 1, "DP": 1}


def layout_from_env(environ: Any = None) -> tuple[dict[str, int], list[str]]:
    """The layout in ``TP``/``CP``/``PP``/``VPP``/``DP`` (positive integers) and its Megatron flags.

    ``VPP`` is the number of virtual stages per pipeline rank (Megatron's
    ``--num-virtual-stages-per-pipeline-rank``); the world size is TP*CP*PP*DP.
    """
    environ = os.environ if environ is None else environ
    layout = {}
    for name, default in LAYOUT_VARIABLES.items():
        raw = environ.get(name, "") or str(default)
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"{name}={raw!r}: give a positive integer (the {name} size of the layout)")
        layout[name] = int(raw)
    flags = ["--tensor-model-parallel-size", str(layout["TP"]), "--context-parallel-size", str(layout["CP"]),
             "--pipeline-model-parallel-size", str(layout["PP"])]
    if layout["VPP"] > 1:
        if layout["PP"] < 2:
            raise ValueError(f"VPP={layout['VPP']} needs PP >= 2 (virtual stages interleave pipeline stages)")
        flags += ["--num-virtual-stages-per-pipeline-rank", str(layout["VPP"])]
    return layout, flags


def world_size(layout: dict[str, int]) -> int:
    return layout["TP"] * layout["CP"] * layout["PP"] * layout["DP"]


def write_text_corpus(prefix: str, max_bytes: int = 600_000, separator: str = "\n\n",
                      eod: int = BYTE_EOD) -> tuple[int, int]:
    """Write ``prefix.bin/.idx``: the Python standard library's ``.py`` files as byte-level documents
    (cut at blank lines: functions and paragraphs, each followed by ``eod``, default 256); returns (documents,
    tokens). Real text whose document lengths span three orders of magnitude, on every machine with
    Python. ``eod=TINY_GPT_EOD`` ends them with the tiny GPT's own EOD, for Megatron's ``--reset-*`` flags."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(str(p) for p in stdlib.glob("*.py"))
    docs = byte_documents(paths, separator=separator, eod=eod, max_bytes=max_bytes)
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    write_indexed_dataset(prefix, docs)
    return len(docs), int(sum(len(d) for d in docs))


#: ``WLB_PIN_CORES=1``: each rank runs on one core of its own (measurements: no rank shares a core)
PIN_VARIABLE = "WLB_PIN_CORES"

#: glibc malloc settings for timed CPU runs: large tensors come from the heap and freed memory stays there,
#: instead of an mmap, first-touch page faults and an munmap per attention score buffer. Without them the
#: tiny GPT's ranks spent 40% of their thread time in the kernel and the same micro-batch's thread time
#: varied 14-18% between repeats (issue 39's A/A run, 2-core VM). glibc reads them at process start, so a
#: launcher sets them in the workers' environment (``measurement_env``).
MEASUREMENT_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 34),
                          "MALLOC_TOP_PAD_": str(1 << 28)}


def measurement_env(layout: dict[str, str], environ: Any = None) -> dict[str, str]:
    """The environment of a timed CPU training run: ``environ`` (default ``os.environ``), the layout
    (TP/CP/PP/DP), one core and one thread per rank, no CUDA, and ``MEASUREMENT_MALLOC_ENV`` where the
    environment does not set those variables itself."""
    base = dict(os.environ if environ is None else environ)
    return {**MEASUREMENT_MALLOC_ENV, **base, **layout, PIN_VARIABLE: "1", "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": ""}


def pin_to_core(environ: Any = None) -> int | None:
    """With ``WLB_PIN_CORES=1``, bind this process to core ``LOCAL_RANK`` of the cores it may use, and
    torch to one thread; returns the core (None when not asked). Refuses more ranks than cores."""
    env = os.environ if environ is None else environ
    if env.get(PIN_VARIABLE, "0") in ("", "0"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    rank = int(env.get("LOCAL_RANK", "0"))
    if rank >= len(cores):
        raise SystemExit(f"{PIN_VARIABLE}=1: local rank {rank} but only {len(cores)} cores ({cores}); run at most "
                         f"{len(cores)} ranks per machine to measure, or unset {PIN_VARIABLE}")
    os.sched_setaffinity(0, {cores[rank]})
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch  # lazy: this module's constants serve benchmarks that import no torch

    torch.set_num_threads(1)
    return cores[rank]


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: ``--write-corpus PREFIX [--tiny-gpt-eod]``, or train: redirects, then the thin launcher or
    ``--pretrain-gpt PATH`` as ``__main__``. ``--tiny-gpt`` puts ``TINY_GPT_ARGS`` and the layout of
    the environment (``layout_from_env``) and a vocabulary covering the data (``tiny_gpt_vocab_flags``)
    before the given flags."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--write-corpus"]:
        if len(argv) not in (2, 3) or argv[2:] not in ([], ["--tiny-gpt-eod"]):
            raise SystemExit("usage: python -m megatron_wlb.megatron.entry.cpu --write-corpus PREFIX [--tiny-gpt-eod] "
                             f"(documents end with {BYTE_EOD}, or with the tiny GPT's EOD {TINY_GPT_EOD})")
        docs, tokens = write_text_corpus(argv[1], eod=TINY_GPT_EOD if argv[2:] else BYTE_EOD)
        print(f"wrote {argv[1]}.bin/.idx: {docs} documents, {tokens} tokens")
        return
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    pin_to_core()
    script = None
    if argv[:1] == ["--pretrain-gpt"]:
        if len(argv) < 2:
            raise SystemExit("--pretrain-gpt needs the path of a Megatron-LM checkout's pretrain_gpt.py")
        script, argv = argv[1], argv[2:]
        if not os.path.isfile(script):
            raise SystemExit(f"--pretrain-gpt {script}: no such file (give a Megatron-LM checkout's pretrain_gpt.py)")
    if argv[:1] == ["--tiny-gpt"]:
        try:
            _, layout_flags = layout_from_env()
        except ValueError as exc:
            raise SystemExit(f"megatron_wlb.megatron.entry.cpu: {exc}") from None
        argv = [*TINY_GPT_ARGS, *layout_flags, *tiny_gpt_vocab_flags(argv[1:]), *argv[1:]]
    elif "--distributed-backend" not in argv:
        argv = [*argv, "--distributed-backend", "gloo"]
    # lazy: both import torch (this module's constants need none); the launcher imports Megatron only later
    from megatron_wlb.megatron.entry import cpu_redirects, launcher

    cpu_redirects.install_cpu_redirects()

    if script is not None:
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        spawn_children_import_this_module(script)  # the torch_dist writer's children must not re-run the script
        cpu_redirects.install_megatron_redirects()
        # what a main user's launcher does (main_schedule's module runner): "wlb" among the checkout's own
        # sequence-packing schedulers, before its flags are parsed (a no-op, saying why, where it has none)
        main_schedule.register()
        sys.argv = [script, *argv]
        with exit_on_startup_error(), launcher.released_at_exit():
            runpy.run_path(script, run_name="__main__")
        return
    cpu_redirects.install_megatron_redirects()
    launcher.main(argv)


def __getattr__(name: str) -> Any:
    """The CUDA redirects (``cpu_redirects``), imported on first use: this module's constants need no torch."""
    if name in ("REDIRECTS", "install_cpu_redirects", "install_megatron_redirects"):
        from megatron_wlb.megatron.entry import cpu_redirects  # lazy: it imports torch

        return getattr(cpu_redirects, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    main()
