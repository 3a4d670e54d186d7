"""A shipped sbatch script submitted to a real SLURM: Debian's slurm-wlm (slurmctld + slurmd + munge on this
machine, CPUs only), the script in CPU mode (WLB_CPU=1: the tiny GPT through Megatron's loop on gloo).

Needs root and the SLURM daemons; where they are missing and apt-get is available (as root), the fixture
installs slurm-wlm (as CI does); otherwise the test is skipped, saying why. Every daemon it starts is
stopped by its process id afterwards.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "sinfo")
MUNGE_KEY = Path("/etc/munge/munge.key")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ensure_slurm() -> None:
    """slurm-wlm's programs on PATH, installed with apt-get where they are missing (or the test skips)."""
    if all(shutil.which(p) for p in DAEMONS) and MUNGE_KEY.is_file():
        return
    if os.geteuid() != 0:
        pytest.skip("SLURM is not installed and installing it (apt-get install slurm-wlm) needs root")
    if shutil.which("apt-get") is None:
        pytest.skip("SLURM is not installed and apt-get is unavailable to install slurm-wlm")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "slurm-wlm"]):
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        if res.returncode:
            pytest.skip(f"apt-get could not install slurm-wlm: {(res.stderr or res.stdout).strip()[-300:]}")
    if not all(shutil.which(p) for p in DAEMONS) or not MUNGE_KEY.is_file():
        pytest.skip("slurm-wlm was installed but its programs or /etc/munge/munge.key are missing")


@pytest.fixture()
def slurm_cluster():
    """A one-node SLURM on localhost: munged (as the munge user, its own socket), slurmctld, slurmd.
    Yields the environment that points sbatch at it."""
    _ensure_slurm()
    if os.geteuid() != 0:
        pytest.skip("starting slurmd and munged needs root")
    work = Path(tempfile.mkdtemp(prefix="wlb-slurm-"))
    work.chmod(0o755)  # munged runs as the munge user and must reach its socket directory
    munge_dir = work / "munge"
    munge_dir.mkdir()
    shutil.chown(munge_dir, "munge", "munge")
    socket_path = munge_dir / "munge.socket"
    pids: list[Path] = [munge_dir / "munged.pid"]
    started = subprocess.run(["su", "-s", "/bin/sh", "munge", "-c",
                              f"munged --socket={socket_path} --pid-file={pids[0]} --log-file={munge_dir}/munged.log "
                              f"--seed-file={munge_dir}/seed"], capture_output=True, text=True, timeout=60)
    if started.returncode:
        shutil.rmtree(work, ignore_errors=True)
        pytest.skip(f"munged did not start: {started.stderr.strip()[-300:]}")
    host = socket.gethostname().split(".")[0]
    for d in ("state", "spool", "run"):
        (work / d).mkdir()
    conf = work / "slurm.conf"
    conf.write_text(f"""ClusterName=wlbtest
SlurmctldHost={host}(127.0.0.1)
AuthType=auth/munge
AuthInfo=socket={socket_path}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
StateSaveLocation={work}/state
SlurmdSpoolDir={work}/spool
SlurmctldPidFile={work}/run/slurmctld.pid
SlurmdPidFile={work}/run/slurmd.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmctldLogFile={work}/slurmctld.log
SlurmdLogFile={work}/slurmd.log
NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    pids += [work / "run" / "slurmctld.pid", work / "run" / "slurmd.pid"]
    try:
        subprocess.run(["slurmctld", "-f", str(conf), "-c"], check=True, env=env, timeout=60)
        subprocess.run(["slurmd", "-f", str(conf)], check=True, env=env, timeout=60)
        deadline = time.time() + 60
        while time.time() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=env).stdout
            if "idle" in state:
                break
            time.sleep(1)
        else:
            log = (work / "slurmctld.log").read_text()[-2000:]
            pytest.fail(f"the SLURM node never became idle; slurmctld log:\n{log}")
        yield env, work
    finally:
        for pid_file in reversed(pids):
            try:
                os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
            except (OSError, ValueError):
                pass
        time.sleep(1)
        shutil.rmtree(work, ignore_errors=True)


def _submit_and_wait(args: list[str], env: dict, cwd: Path, timeout_s: float = 600) -> tuple[tuple[str, str], str]:
    """``sbatch ARGS``, then the job's (final state, exit code) once it ends, and sbatch's output. Polled every
    half second: ``sbatch --wait`` sleeps ever longer between its polls (CI: 42 s for a job of under 30 s)."""
    res = subprocess.run(["sbatch", "--parsable", *args], env=env, cwd=cwd, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    job_id = res.stdout.strip().split(";")[0]
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True, text=True)
        fields = dict(f.split("=", 1) for f in shown.stdout.split() if "=" in f)
        if fields.get("JobState") not in (None, "PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            return (fields["JobState"], fields.get("ExitCode", "")), res.stdout + res.stderr
        time.sleep(0.5)
    pytest.fail(f"SLURM job {job_id} did not end within {timeout_s} s")


def test_a_shipped_sbatch_script_trains_under_slurm_in_cpu_mode(slurm_cluster, tmp_path):
    env, work = slurm_cluster
    job = work / "job"  # reachable by slurmd (root) and outside pytest's private tmp
    job.mkdir()
    job_env = {**env, "WLB_CPU": "1", "WLB_CPU_NPROC_PER_NODE": "2", "PYTHON": sys.executable,
               "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{env['PATH']}",
               "PYTHONPATH": str(ROOT), "LOG_DIR": str(job / "logs"), "CKPT_DIR": str(job / "ckpt")}
    job_env.pop("MEGATRON_LM", None)
    script = ROOT / "scripts" / "slurm" / "550m_64k.sbatch"  # 4 nodes x 8 GPUs on a GPU cluster
    state, submitted = _submit_and_wait(["--nodes=1", "--gpus-per-node=0", str(script)], job_env, job)
    outputs = list(job.glob("wlb-550m_64k-*.out"))
    log = outputs[0].read_text() if outputs else ""
    assert state == ("COMPLETED", "0:0") and outputs, f"{state} {submitted}\n{log[-4000:]}"
    assert "(CPU mode): 1 node(s) x 2 process(es), DP=2" in log
    assert "iteration        4/       4" in log, log[-4000:]
    assert log.count("[wlb] iteration") >= 4 and "lm loss" in log
