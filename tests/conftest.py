"""Shared test fixtures and helpers (one of each)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str):
    """``benchmarks/<name>.py`` (the lab wing), or else ``scripts/<name>.py``, as a module (registered under
    ``name``, as dataclasses need; its folder on the path, as the benchmarks import ``_results`` and each other)."""
    import importlib.util

    folder = ROOT / "benchmarks" if (ROOT / "benchmarks" / f"{name}.py").exists() else ROOT / "scripts"
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def fake_cluster(tmp_path: Path, nodes: tuple[str, ...] = ("node-a", "node-b"), nodelist: str = "node-[a-b]"
                 ) -> tuple[dict, Path]:
    """An environment whose PATH has stub ``srun`` (records ``srun`` and its argv in the returned file) and
    ``scontrol`` (lists ``nodes``), and a patched-looking Megatron-LM checkout, for running our launchers."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    record = tmp_path / "argv.txt"
    (bindir / "srun").write_text('#!/bin/bash\nprintf "%s\\n" "srun" "$@" > "$WLB_RECORD"\n')
    (bindir / "scontrol").write_text("#!/bin/bash\n" + "".join(f"echo {n}\n" for n in nodes))
    for stub in ("srun", "scontrol"):
        (bindir / stub).chmod(0o755)
    mlm = tmp_path / "mlm"
    mlm.mkdir()
    (mlm / "pretrain_gpt.py").write_text("_wlb.apply(middle_stage_batches=True)\n")
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "WLB_RECORD": str(record),
           "MEGATRON_LM": str(mlm), "DATA_PATH": "0.3 /data/a_text_document 0.7 /data/b_text_document",
           "TOKENIZER_MODEL": "meta-llama/Llama-2-7b-hf", "SLURM_JOB_NODELIST": nodelist, "SLURM_JOB_ID": "4242",
           "CKPT_DIR": str(tmp_path / "ckpt"), "LOG_DIR": str(tmp_path / "logs"), "PYTHONPATH": str(ROOT),
           "PYTHON": sys.executable}
    return env, record



def job_python_env(env: dict[str, str] | None = None, python: str = sys.executable) -> dict[str, str]:
    """``env`` (default os.environ) as scripts/lib/job_python.sh's ``use_job_python PYTHON`` leaves it (PATH, and
    PYENV_VERSION under pyenv): Megatron's dataset helpers built for ``python``, as the user scripts do."""
    import subprocess

    out = subprocess.run(["bash", "-c", 'source "$1" && use_job_python "$2" && env -0', "bash",
                          str(ROOT / "scripts" / "lib" / "job_python.sh"), python],
                         env=dict(os.environ if env is None else env), capture_output=True, check=True).stdout
    return dict(item.split("=", 1) for item in out.decode().split("\0") if "=" in item)

#: how long a gloo world may run before it counts as hung
WORLD_TIMEOUT_S = 240


def _world_entry(worker, rank: int, world: int, store: str, queue, kwargs: dict) -> None:
    import traceback
    import warnings

    warnings.filterwarnings("ignore")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        worker(rank, world, **kwargs)
        dist.barrier()
        queue.put((rank, None))
    except BaseException:  # noqa: BLE001 - every failure goes to the parent
        queue.put((rank, traceback.format_exc()))
        return
    # done: the result is sent (the queue flushed), so leave without the interpreter's teardown of torch and
    # Megatron (a spawned child runs it, ~1-2 s of CPU; a forked one leaves like this already)
    queue.close()
    queue.join_thread()
    os._exit(0)


def run_world(worker, world: int, *, start_method: str = "spawn", **kwargs) -> None:
    """Run ``worker(rank, world, **kwargs)`` on ``world`` processes joined in one gloo group (a file store,
    so no ports), and fail with every rank's traceback on error, or on a hang after WORLD_TIMEOUT_S.
    ``start_method="fork"`` lets the workers inherit the parent's imports (torch, megatron.core)."""
    import queue as queue_mod
    import tempfile

    import pytest
    import torch.multiprocessing as mp

    ctx = mp.get_context(start_method)
    results: dict[int, str | None] = {}
    with tempfile.TemporaryDirectory() as tmp:
        queue = ctx.Queue()
        procs = [ctx.Process(target=_world_entry, args=(worker, r, world, os.path.join(tmp, "store"), queue, kwargs),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        try:
            while len(results) < world:
                try:
                    rank, err = queue.get(timeout=WORLD_TIMEOUT_S)
                except queue_mod.Empty:
                    pytest.fail(f"gloo world of {world} hung for {WORLD_TIMEOUT_S}s; ranks done: {sorted(results)}")
                results[rank] = err
                if err is not None:
                    break
        finally:
            done = len(results) == world and all(e is None for e in results.values())
            for p in procs:
                p.join(timeout=5 if done else 0.1)
                if p.is_alive():
                    p.terminate()
    errors = {r: e for r, e in results.items() if e is not None}
    assert not errors, "\n".join(f"--- rank {r} ---\n{e}" for r, e in errors.items())


# -- the pinned Megatron-LM checkout: one variable, one lookup ---------------------------------------------
#: names a Megatron-LM git repository (a checkout or a bare mirror) that holds the pinned commit
MEGATRON_LM_VAR = "MEGATRON_LM"
#: where this project's machines keep a mirror; used when the variable is unset
DEFAULT_MEGATRON_LM = "/work/.mirror/NVIDIA+Megatron-LM/repo"


def release_commit(tag: str = "core_v0.16.1") -> str:
    """The commit a supported release's patches are pinned to (``patches/<tag>/PINNED_COMMIT``)."""
    return (ROOT / "patches" / tag / "PINNED_COMMIT").read_text().strip()


def megatron_source(tag: str = "core_v0.16.1", commit: str | None = None) -> tuple[str | None, str]:
    """(the git repository holding ``tag``'s pinned commit (or ``commit``), or None; why not, for a skip message)."""
    import shutil
    import subprocess

    pinned = commit or release_commit(tag)
    source = os.environ.get(MEGATRON_LM_VAR) or DEFAULT_MEGATRON_LM
    hint = (f"set {MEGATRON_LM_VAR} to a Megatron-LM git checkout or mirror holding the pinned commit "
            f"{pinned[:12]} ({tag})")
    if shutil.which("git") is None:
        return None, "git is not installed"
    if not os.path.isdir(source):
        return None, f"no Megatron-LM repository at {source}: {hint}"
    found = subprocess.run(["git", "-C", source, "cat-file", "-e", f"{pinned}^{{commit}}"], capture_output=True)
    if found.returncode:
        return None, f"{source} does not hold {pinned[:12]}: {hint}"
    return source, ""


def pinned_megatron_source() -> tuple[str | None, str]:
    """``megatron_source`` of the pinned core_v0.16.1."""
    return megatron_source("core_v0.16.1")


def megatron_checkout(dest: Path, tag: str = "core_v0.16.1", commit: str | None = None) -> Path:
    """A fresh checkout of ``tag``'s pinned commit (or ``commit``) at ``dest`` (a shared clone: seconds), or the
    test is skipped."""
    import subprocess

    import pytest

    source, why = megatron_source(tag, commit)
    if source is None:
        pytest.skip(why)
    subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", source, str(dest)], check=True)
    subprocess.run(["git", "-C", str(dest), "checkout", "-q", "--detach", commit or release_commit(tag)], check=True)
    return dest


def pinned_megatron_checkout(dest: Path) -> Path:
    """A fresh checkout of the pinned core_v0.16.1 commit at ``dest``, or the test is skipped."""
    return megatron_checkout(dest, "core_v0.16.1")


# -- shared fixtures: defined once, one meaning each ------------------------------------------------------------
@pytest.fixture(scope="module")
def run7b():
    """The paper's 7B-128K config (configs/7b_128k.yaml) and its analytic cost model at its own layout."""
    from megatron_wlb.config import load_config
    from megatron_wlb.costmodel import build_cost_model

    config = load_config("7b_128k")
    return config, build_cost_model(config.model, config.layout)


@pytest.fixture(scope="module")
def run7b_dp4():
    """``run7b`` with its cost model at DP 4 (the schedule tests deal micro-batches to four DP ranks)."""
    import dataclasses

    from megatron_wlb.config import load_config
    from megatron_wlb.costmodel import build_cost_model

    config = load_config("7b_128k")
    return config, build_cost_model(config.model, dataclasses.replace(config.layout, dp=4))


@pytest.fixture(scope="module")
def embedded_lengths():
    """The embedded length distribution (megatron_wlb/data/dist_wlbllm.json)."""
    from megatron_wlb.data import load_lengths

    return load_lengths()


@pytest.fixture(scope="session")
def text_corpus(tmp_path_factory) -> str:
    """A real Megatron .bin/.idx text corpus for the training tests: the standard library's text, byte tokens
    (``megatron_wlb.megatron.entry.cpu.write_text_corpus``); its prefix."""
    from megatron_wlb.megatron.entry.cpu import write_text_corpus

    prefix = str(tmp_path_factory.mktemp("corpus") / "stdlib_text_document")
    docs, tokens = write_text_corpus(prefix)
    assert docs > 1000 and tokens > 500_000
    return prefix


@pytest.fixture(scope="session")
def eod_corpus(tmp_path_factory) -> str:
    """The stdlib corpus with every document ending in the tiny GPT tokenizer's own EOD (NullTokenizer,
    vocabulary 300: EOD 299), so Megatron's --reset-* flags find the document boundaries."""
    from megatron_wlb.megatron.entry.cpu import TINY_GPT_EOD, write_text_corpus

    prefix = str(tmp_path_factory.mktemp("eod_corpus") / "stdlib_eod_text_document")
    write_text_corpus(prefix, eod=TINY_GPT_EOD)  # what scripts/compare_loss.sh --cpu writes
    return prefix

