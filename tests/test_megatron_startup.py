"""Megatron's start-up builds on a machine without a toolchain (issue 20, items 2 and 3): the dataset-helper
``make`` and core 0.16's ``fused_kernels.load`` (``nvcc -V``) are skipped where they cannot succeed, and
run unchanged where they can; on the pinned checkout, Megatron's own ``_compile_dependencies`` passes."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from megatron_wlb.megatron.hooks import startup  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def helpers(monkeypatch):
    """Megatron's datasets.utils with a recording compile_helpers and no prebuilt helpers_cpp."""
    from megatron.core.datasets import utils

    calls: list[str] = []

    def original() -> None:
        calls.append("make")
        raise SystemExit(1)  # what Megatron's does when make fails

    monkeypatch.setattr(utils, "compile_helpers", original)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.endswith("helpers_cpp")
                        else real_find_spec(name, *a))
    monkeypatch.setattr(startup.os.path, "isfile", lambda p: True)  # the Makefile and Python.h are there
    return utils, calls


def test_dataset_helpers_are_skipped_without_a_toolchain(helpers, capsys):
    utils, calls = helpers
    assert startup.guard_dataset_helpers(which=lambda tool: None) == "skipped"
    utils.compile_helpers()  # no make, no sys.exit
    assert calls == []
    out = capsys.readouterr().out
    assert "missing: make, g++, python3-config, python3" in out and "WLB-LLM's iterators do not use them" in out
    assert startup.guard_dataset_helpers() == "skipped"  # idempotent: the guard is not wrapped twice


def test_dataset_helpers_compile_where_the_toolchain_is(helpers, monkeypatch):
    utils, calls = helpers
    monkeypatch.setattr(startup, "missing_helper_toolchain", lambda which: [])
    assert startup.guard_dataset_helpers() == "compile"
    with pytest.raises(SystemExit):
        utils.compile_helpers()
    assert calls == ["make"]


def test_prebuilt_dataset_helpers_are_not_rebuilt(monkeypatch):
    from megatron.core.datasets import utils

    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
        pytest.skip("this megatron-core has no compiled helpers_cpp")
    monkeypatch.setattr(utils, "compile_helpers", lambda: (_ for _ in ()).throw(AssertionError("make ran")))
    assert startup.guard_dataset_helpers() == "prebuilt"
    utils.compile_helpers()


def test_missing_toolchain_names_each_tool(monkeypatch):
    monkeypatch.setattr(startup.os.path, "isfile", lambda p: False)
    missing = startup.missing_helper_toolchain(which=lambda tool: None if tool in ("make", "python3") else "/x")
    assert missing == ["make", "python3", "Python.h (the Python development headers)"]


_PINNED_STARTUP = r"""
import os, sys, types
import torch.distributed as dist
import torch.utils.cpp_extension as cpp
cpp.CUDA_HOME = None                      # a GPU machine with torch's CUDA runtime and no CUDA toolkit
from megatron.legacy import fused_kernels
try:
    fused_kernels.load(types.SimpleNamespace(rank=0))
    raise SystemExit("fused_kernels.load passed without CUDA_HOME: the test premise is wrong")
except TypeError:
    pass                                  # Megatron's own: None + "/bin/nvcc"
import megatron_wlb.megatron as W
W.apply()
import megatron.training.global_vars as GV, megatron.training.initialize as I
GV.set_args(types.SimpleNamespace(seq_length=256, num_attention_heads=4, tensor_model_parallel_size=1,
                                  micro_batch_size=1, fp16=False, bf16=True, masked_softmax_fusion=False, rank=0))
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
I._compile_dependencies()                 # rank 0 "compiles" the helpers, every rank loads the fused kernels
print("startup OK")
"""


@pytest.mark.slow
def test_pinned_startup_without_cuda_toolkit_or_make(tmp_path):
    """The pinned checkout's _compile_dependencies, after apply(), with CUDA_HOME None and no make on PATH."""
    from conftest import pinned_megatron_checkout

    code = pinned_megatron_checkout(tmp_path / "Megatron-LM")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python").symlink_to(sys.executable)  # the only tool on PATH: no make, no g++, no python3-config
    env = {**os.environ, "PATH": str(bindir), "PYTHONPATH": os.pathsep.join([str(code), str(ROOT)]),
           "PYTHONWARNINGS": "ignore"}
    env.pop("CUDA_HOME", None)
    proc = subprocess.run([sys.executable, "-c", _PINNED_STARTUP, str(tmp_path / "store")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "startup OK" in proc.stdout
    assert "dataset helpers are not built and cannot be here (missing: make" in proc.stdout
    assert "fused_kernels.load, which only reads nvcc's version" in proc.stdout
