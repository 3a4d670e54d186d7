"""The test harness's launcher of a one-node world: what ``torchrun --standalone --nproc-per-node N`` does for a
script, without its agent process (it imports torch, ~2 s of CPU, and takes ~1.5 s to stop after the ranks).

Each rank is a plain subprocess with the environment torchrun gives its workers (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of a free port, ``OMP_NUM_THREADS=1`` unless set, ...); their
stdout and stderr are shared, as under torchrun. When a rank exits non-zero, the others are stopped (SIGTERM,
then SIGKILL), as torchrun's agent does, and the world's exit code is 1. Used by the training probe's runs
(``megatron_train_runs.train`` and the tests built on it); tests of the launchers and scripts keep their commands.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence


def free_port() -> int:
    """A TCP port free on this machine now (rank 0's store binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_env(env: Mapping[str, str], rank: int, world: int, port: int) -> dict[str, str]:
    """``env`` plus what torchrun sets for worker ``rank`` of a one-node world of ``world``."""
    out = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
           "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default",
           "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
           "TORCHELASTIC_RUN_ID": "none"}
    out.setdefault("OMP_NUM_THREADS", "1")
    return out


def _stop(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """SIGTERM every rank still running (its process group: a rank's own children too), SIGKILL after
    ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        running = [p for p in procs if p.poll() is None]
        for p in running:
            with contextlib.suppress(ProcessLookupError):  # it ended between poll() and the signal
                os.killpg(p.pid, sig)
        deadline = time.monotonic() + grace_s
        while any(p.poll() is None for p in running) and time.monotonic() < deadline:
            time.sleep(0.05)


def run_ranks(args: Sequence[str], world: int, *, env: Mapping[str, str], cwd: str | os.PathLike,
              timeout: float) -> subprocess.CompletedProcess:
    """``python args...`` as ``world`` ranks; their exit code (0, or 1 when a rank failed), stdout and stderr.
    Raises ``subprocess.TimeoutExpired`` after ``timeout`` seconds (every rank stopped)."""
    cmd = [sys.executable, *args]
    port = free_port()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        procs = [subprocess.Popen(cmd, env=rank_env(env, rank, world, port), cwd=cwd, stdout=out, stderr=err,
                                  stdin=subprocess.DEVNULL, start_new_session=True) for rank in range(world)]
        deadline = time.monotonic() + timeout
        returncode = 0
        try:
            while True:
                codes = [p.poll() for p in procs]
                if any(c not in (None, 0) for c in codes):
                    returncode = 1
                    break
                if all(c == 0 for c in codes):
                    break
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(cmd, timeout)
                time.sleep(0.05)
        finally:
            _stop(procs)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, returncode, out.read(), err.read())
