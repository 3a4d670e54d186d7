#!/usr/bin/env python
"""Packing benchmark, one command: ``python scripts/bench_packing.py [extra wlb bench options]``.

Runs ``wlb bench`` on the embedded WLB-LLM length distribution (published by the DistCA authors as
a stand-in for the paper's data, see megatron_wlb/data/README.md) and on the token lengths of the
running interpreter's standard library, with configs/7b_128k.yaml (200 global batches; solver rows
capped at 50), plus the 8K-GPU layout configs/405b_128k_8k.yaml (64 micro-batches per iteration).
Writes docs/results/packing_bench.md and .json, naming the machine.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_wlb.cli.main import main  # noqa: E402

DEFAULT = ["bench", "--config", "7b_128k", "--iterations", "200", "--solver-iterations", "50",
           "--lengths", "wlbllm,stdlib", "--scale-config", "405b_128k_8k", "--scale-iterations", "200",
           "--out", str(ROOT / "docs" / "results"), "--label", "python scripts/bench_packing.py"]

if __name__ == "__main__":
    sys.exit(main(DEFAULT + sys.argv[1:]))
