"""README.md's quick start, run as written (issue 58 item 4): the commands are parsed out of the README, so the test
fails when the README changes to something that does not run.

Run here: the no-GPU block, from the checkout, line by line (``scripts/train_cpu.sh --wlb-packer wlb``: a tiny GPT
through Megatron's own loop on CPU; ``wlb analyze`` of the corpus it wrote with the small config ``550m_8k``).
Not run here, and why:
- the install lines: pip and the package index (tests/test_install_advice.py checks that they are version.py's
  one install advice, naming a megatron-core release that setup.py's pin admits and pip installed here);
- ``torchrun ... -m megatron_wlb.megatron.entry.launcher`` and ``wlb calibrate --config ...``: they need GPUs (the
  launcher on CPU is tests/test_megatron_train.py's);
- ``wlb reproduce``: its full run (every config, 100 iterations each) takes minutes (404 s on a shared 2-core
  machine); here it runs as written plus ``--iterations 1 --out TMP`` (the same configs and methods, one iteration
  each), beside the other two.
About a minute on an idle 2-core machine (training 40 s, then the analysis 15-20 s; the simulator's run beside them).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
QUICK_START = README[README.index("## Quick start"):README.index("\n## ", README.index("## Quick start") + 1)]


def no_gpu_commands() -> list[str]:
    """The commands of the quick start's no-GPU block, comments dropped, in order."""
    block = re.search(r"No GPU\?.*?```bash\n(.*?)```", QUICK_START, re.S)
    assert block is not None, "the quick start has no 'No GPU?' bash block"
    return [shlex.join(shlex.split(line, comments=True)) for line in block.group(1).splitlines()
            if shlex.split(line, comments=True)]


def test_the_no_gpu_block_is_what_this_test_runs():
    """The block holds the three commands this test knows how to run (a new one needs its case here)."""
    assert [shlex.split(c)[:2] for c in no_gpu_commands()] == [
        ["scripts/train_cpu.sh", "--wlb-packer"], ["wlb", "analyze"], ["wlb", "reproduce"]]


@pytest.mark.slow
def test_the_no_gpu_commands_run_as_written(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]])}
    env.pop("OUT", None)
    env.pop("DATA", None)
    commands = no_gpu_commands()
    reproduce = [c for c in commands if shlex.split(c)[:2] == ["wlb", "reproduce"]]
    # the simulator's run needs nothing of the others: beside them (--iterations 1; a later --out wins)
    aside = [subprocess.Popen([*shlex.split(c), "--iterations", "1", "--out", str(tmp_path / "reproduce")], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in reproduce]
    for command in (c for c in commands if c not in reproduce):
        argv = shlex.split(command)
        res = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, f"{command}: exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
        if argv[0] == "scripts/train_cpu.sh":
            assert re.search(r"iteration +\d+/ +\d+ .*lm loss", res.stdout + res.stderr), command
        if argv[:2] == ["wlb", "analyze"]:
            assert "iterations x" in res.stdout and (ROOT / argv[argv.index("--out") + 1] / "report.md").is_file()
            prefix = argv[argv.index("--data-prefix") + 1]
            assert (ROOT / f"{prefix}.idx").is_file()  # the corpus train_cpu.sh wrote, at the path the README names
    for proc, command in zip(aside, reproduce):
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{command} --iterations 1: exit {proc.returncode}\n{out[-3000:]}"
        assert (tmp_path / "reproduce" / "report.md").is_file()
