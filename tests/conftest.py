"""Shared test fixtures and helpers (one of each)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
