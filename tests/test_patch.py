"""The launch side: scripts/apply_patches.sh on a tiny synthetic git repo (always) and with the real
patch on a checkout of the pinned Megatron-LM commit materialised from a local mirror (when one is
present); the generated SLURM scripts (one per config, current, `bash -n` clean, and run under stub
srun/scontrol to check the torchrun command's layout); scripts/launch_local.sh in DRY_RUN mode.

The Megatron-LM repository is found through one variable, $MEGATRON_LM (conftest.pinned_megatron_source;
default: this project's mirror); where none holds the pinned commit those tests skip, and the synthetic
ones carry the logic (wrong commit refused, dirty tree refused, clean apply, idempotent second run).
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import conftest
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "apply_patches.sh"
PATCHES = ROOT / "patches"
PINNED = (PATCHES / "core_v0.16.1" / "PINNED_COMMIT").read_text().strip()

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


def run_script(target: Path, patches_dir: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if patches_dir is not None:
        env["WLB_PATCHES_DIR"] = str(patches_dir)
    return subprocess.run(["bash", str(SCRIPT), str(target)], capture_output=True, text=True, env=env, timeout=120)


@pytest.fixture()
def synthetic(tmp_path: Path):
    """A two-commit repo, a patch made with git diff against the second commit, and a patches dir."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "pretrain.py").write_text("def main():\n    return 1\n")
    (repo / "README").write_text("readme\n")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "first")
    old = git(repo, "rev-parse", "HEAD")
    (repo / "pretrain.py").write_text("def main():\n    return 2\n")
    git(repo, "commit", "-q", "-am", "second")
    pinned = git(repo, "rev-parse", "HEAD")
    (repo / "pretrain.py").write_text("import hook\n\ndef main():\n    return 2\n")
    patch = git(repo, "diff") + "\n"
    git(repo, "checkout", "-q", "--", ".")
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "hook.patch").write_text(patch)
    (patches / "PINNED_COMMIT").write_text(pinned + "\n")
    return repo, patches, pinned, old


def test_clean_apply_then_idempotent(synthetic):
    repo, patches, pinned, _ = synthetic
    first = run_script(repo, patches)
    assert first.returncode == 0, first.stderr
    assert "applied hook.patch" in first.stdout
    assert (repo / "pretrain.py").read_text().startswith("import hook\n")
    second = run_script(repo, patches)
    assert second.returncode == 0, second.stderr
    assert "already applied" in second.stdout
    assert (repo / "pretrain.py").read_text().count("import hook") == 1
    assert git(repo, "rev-parse", "HEAD") == pinned


def test_wrong_commit_refused(synthetic):
    repo, patches, pinned, old = synthetic
    git(repo, "checkout", "-q", old)
    res = run_script(repo, patches)
    assert res.returncode == 1
    assert old in res.stderr and pinned in res.stderr and "checkout" in res.stderr
    assert (repo / "pretrain.py").read_text() == "def main():\n    return 1\n"


def test_dirty_tree_refused(synthetic):
    repo, patches, _, _ = synthetic
    (repo / "README").write_text("local edit\n")
    res = run_script(repo, patches)
    assert res.returncode == 1
    assert "modified tracked files" in res.stderr and "README" in res.stderr
    assert "import hook" not in (repo / "pretrain.py").read_text()


def test_untracked_files_do_not_block(synthetic):
    repo, patches, _, _ = synthetic
    (repo / "run.log").write_text("untracked\n")
    assert run_script(repo, patches).returncode == 0


def test_applied_plus_other_edits_refused(synthetic):
    repo, patches, _, _ = synthetic
    assert run_script(repo, patches).returncode == 0
    (repo / "README").write_text("local edit\n")
    res = run_script(repo, patches)
    assert res.returncode == 1 and "other modified files" in res.stderr and "README" in res.stderr


def test_patch_that_does_not_apply_is_reported(synthetic):
    repo, patches, _, _ = synthetic
    (patches / "hook.patch").write_text((patches / "hook.patch").read_text().replace("return 2", "return 9"))
    res = run_script(repo, patches)
    assert res.returncode == 1 and "does not apply" in res.stderr
    assert git(repo, "status", "--porcelain", "--untracked-files=no") == ""


def test_not_a_git_checkout_and_bad_pin(tmp_path: Path, synthetic):
    _, patches, _, _ = synthetic
    plain = tmp_path / "plain"
    plain.mkdir()
    res = run_script(plain, patches)
    assert res.returncode == 1 and "not a git checkout" in res.stderr
    (patches / "PINNED_COMMIT").write_text("core_v0.16.1\n")
    res = run_script(plain, patches)
    assert res.returncode == 1 and "40-hex" in res.stderr


def _content_manifests(repo: Path, patches: Path) -> None:
    """PINNED_FILES / PATCHED_FILES for the synthetic repo: the touched file's sha256 before and after."""
    import hashlib

    digest = hashlib.sha256((repo / "pretrain.py").read_bytes()).hexdigest()
    (patches / "PINNED_FILES.sha256").write_text(f"{digest}  pretrain.py\n")
    patched = b"import hook\n\ndef main():\n    return 2\n"
    (patches / "PATCHED_FILES.sha256").write_text(f"{hashlib.sha256(patched).hexdigest()}  pretrain.py\n")


def _no_git_path(tmp_path: Path) -> str:
    """A PATH on which `git` fails loudly (a machine without git), other tools as usual."""
    bindir = tmp_path / "nogit"
    bindir.mkdir(exist_ok=True)
    (bindir / "git").write_text("#!/bin/sh\necho 'git must not be called' >&2\nexit 127\n")
    (bindir / "git").chmod(0o755)
    return f"{bindir}:{os.environ['PATH']}"


@pytest.mark.parametrize("with_git", [True, False])
def test_tree_without_git_is_identified_by_content(tmp_path: Path, synthetic, with_git: bool):
    """An exported copy (no .git), on a machine with or without git: patched when its files are the pinned
    commit's, a no-op when already patched, refused when they are anything else (issue 20, item 1)."""
    repo, patches, _, _ = synthetic
    _content_manifests(repo, patches)
    tree = tmp_path / "export"
    shutil.copytree(repo, tree, ignore=shutil.ignore_patterns(".git"))
    env = {**os.environ, "WLB_PATCHES_DIR": str(patches)}
    if not with_git:
        env["PATH"] = _no_git_path(tmp_path)

    def run() -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(SCRIPT), str(tree)], capture_output=True, text=True, env=env, timeout=60)

    first = run()
    assert first.returncode == 0, first.stderr
    assert "applied hook.patch" in first.stdout and "git must not be called" not in first.stderr
    assert (tree / "pretrain.py").read_text().startswith("import hook\n")
    again = run()
    assert again.returncode == 0 and "already applied" in again.stdout
    (tree / "pretrain.py").write_text("def main():\n    return 7\n")
    refused = run()
    assert refused.returncode == 1 and "match no supported release" in refused.stderr


def test_gpu_smoke_uses_a_given_tree_without_git(tmp_path: Path):
    """scripts/gpu_smoke_train.sh with MEGATRON_LM set to an already patched copy (no .git) on a machine
    without git: no clone, the patch step is a no-op, the data is written (issue 20, item 1)."""
    import hashlib

    tree = tmp_path / "Megatron-LM"
    tree.mkdir()
    (tree / "pretrain_gpt.py").write_text("_wlb.apply(middle_stage_batches=True)\n")
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "PINNED_COMMIT").write_text(PINNED + "\n")
    (patches / "x.patch").write_text("not applied: the tree is already patched\n")
    (patches / "PINNED_FILES.sha256").write_text(f"{'0' * 64}  pretrain_gpt.py\n")
    digest = hashlib.sha256((tree / "pretrain_gpt.py").read_bytes()).hexdigest()
    (patches / "PATCHED_FILES.sha256").write_text(f"{digest}  pretrain_gpt.py\n")
    env = {**os.environ, "PATH": _no_git_path(tmp_path), "MEGATRON_LM": str(tree), "WLB_PATCHES_DIR": str(patches),
           "PREPARE_ONLY": "1", "MAX_BYTES": "20000", "PYTHONPATH": str(ROOT)}
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_smoke_train.sh"), str(tmp_path / "out")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "already applied" in res.stdout and "git must not be called" not in res.stderr
    assert (tmp_path / "out" / "data" / "stdlib_text_document.idx").is_file()


@pytest.mark.parametrize("tag", sorted(p.name for p in PATCHES.iterdir() if p.is_dir()))
def test_content_manifests_name_the_pinned_files(tag):
    """Every release ships both manifests, covering exactly the files its patches touch (their digests are
    checked against the pinned commits by test_manifests_are_those_of_the_pinned_commits)."""
    release = PATCHES / tag
    touched = set(re.findall(r"^\+\+\+ b/(\S+)", "".join(p.read_text() for p in release.glob("*.patch")), re.M))
    assert touched
    for manifest in ("PINNED_FILES.sha256", "PATCHED_FILES.sha256"):
        rows = [line.split() for line in (release / manifest).read_text().splitlines() if line.strip()]
        assert {path for _, path in rows} == touched and all(len(h) == 64 for h, _ in rows)


def _release_source(tag: str) -> str:
    source, why = conftest.megatron_source(tag)
    if source is None:
        pytest.skip(why)
    return source


@pytest.mark.parametrize("tag", ["core_v0.16.1", "core_v0.19.0"])
def test_manifests_are_those_of_the_pinned_commits(tag):
    """scripts/patch_manifests.py --check: the shipped manifests equal those computed from the pinned commit's
    files, before and after the release's patches (the script that writes them)."""
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "patch_manifests.py"), _release_source(tag),
                          "--check"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("tag", ["core_v0.16.1", "core_v0.19.0"])
def test_a_plain_copy_of_each_pinned_tree_is_patched_by_content(tag, tmp_path):
    """A copy of the pinned commit's whole tree without .git (git archive: an exported kit) is identified by
    content and patched; a second run is a no-op."""
    tree = tmp_path / "Megatron-LM"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", _release_source(tag), "archive", conftest.release_commit(tag)],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    assert not (tree / ".git").exists()
    res = run_script(tree)
    assert res.returncode == 0, res.stderr
    assert f"patched for WLB-LLM ({tag}" in res.stdout and "identified by content" in res.stdout
    assert "_wlb.apply(middle_stage_batches=True)" in (tree / "pretrain_gpt.py").read_text()
    again = run_script(tree)
    assert again.returncode == 0 and "already applied" in again.stdout and tag in again.stdout


def test_shipped_pins_and_patches_are_consistent():
    """One folder per patched release; each pin is a full sha that version.py names for that tag; each patch
    touches pretrain_gpt.py and calls apply() saying it feeds middle stages."""
    from megatron_wlb.megatron.args.version import PATCHED_CHECKOUTS, PINNED_MEGATRON_COMMIT

    assert PINNED == PINNED_MEGATRON_COMMIT
    folders = sorted(p.name for p in PATCHES.iterdir() if p.is_dir())
    assert folders == sorted(PATCHED_CHECKOUTS) == ["core_v0.16.1", "core_v0.19.0"]
    for tag, commit in PATCHED_CHECKOUTS.items():
        assert (PATCHES / tag / "PINNED_COMMIT").read_text().strip() == commit and len(commit) == 40
        patch = (PATCHES / tag / "pretrain_gpt_wlb.patch").read_text()
        assert "+++ b/pretrain_gpt.py" in patch and "_wlb.apply(middle_stage_batches=True)" in patch


def test_the_release_is_chosen_by_the_checkouts_commit(synthetic, tmp_path):
    """A patches folder of releases: the one pinned to HEAD applies; a commit none is pinned to is refused
    naming every supported commit and the launcher."""
    repo, patches, pinned, old = synthetic
    root = tmp_path / "releases"
    shutil.copytree(patches, root / "core_v9.9.9")
    (root / "core_v0.0.1").mkdir()
    (root / "core_v0.0.1" / "PINNED_COMMIT").write_text(old + "\n")
    (root / "core_v0.0.1" / "other.patch").write_text("not a patch\n")
    res = run_script(repo, root)
    assert res.returncode == 0 and "applied hook.patch" in res.stdout and "core_v9.9.9" in res.stdout
    git(repo, "checkout", "-q", "--", ".")
    (repo / "new.txt").write_text("x")
    git(repo, "add", "new.txt")
    git(repo, "commit", "-q", "-m", "third")
    res = run_script(repo, root)
    assert res.returncode == 1
    assert pinned in res.stderr and old in res.stderr and "megatron_wlb.megatron.entry.launcher" in res.stderr


def test_the_functions_the_patches_call_exist():
    """Read, not imported (fast): the names each patch calls are defined in megatron_wlb."""
    def defined(path: str) -> set[str]:
        return {n.name for n in ast.walk(ast.parse((ROOT / path).read_text())) if isinstance(n, ast.FunctionDef)}

    assert "packed_seq_params_from_iterator" in (PATCHES / "core_v0.16.1" / "pretrain_gpt_wlb.patch").read_text()
    assert "packed_seq_params_from_iterator" in defined("megatron_wlb/megatron/hooks/cp_hooks.py")
    assert "_wlb.pretrain_gpt_batch(" in (PATCHES / "core_v0.19.0" / "pretrain_gpt_wlb.patch").read_text()
    assert "packed_seq_params_of(cu_seqlens)" in (PATCHES / "core_v0.19.0" / "pretrain_gpt_wlb.patch").read_text()
    assert "packed_seq_params_of" in defined("megatron_wlb/megatron/hooks/cp_hooks.py")
    assert "pretrain_gpt_batch" in defined("megatron_wlb/megatron/data/iterators.py")
    package = ast.parse((ROOT / "megatron_wlb/megatron/__init__.py").read_text())  # re-exported by the package
    assert "pretrain_gpt_batch" in {a.name for n in ast.walk(package) if isinstance(n, ast.ImportFrom) for a in n.names}


needs_mirror = pytest.mark.skipif(conftest.pinned_megatron_source()[0] is None,
                                  reason=conftest.pinned_megatron_source()[1])


@pytest.fixture(scope="module")
def pinned_checkout(tmp_path_factory) -> Path:
    """The pinned commit, checked out from $MEGATRON_LM's repository (a shared clone outside this repo)."""
    return conftest.pinned_megatron_checkout(tmp_path_factory.mktemp("mlm") / "Megatron-LM")


@needs_mirror
@pytest.mark.slow
def test_real_patch_on_pinned_checkout(pinned_checkout: Path, tmp_path: Path):
    """Apply the real patch to the pinned commit, re-apply (no-op), import and drive the patched code."""
    mlm = pinned_checkout
    original = (mlm / "pretrain_gpt.py").read_text()
    check = ["sha256sum", "--quiet", "--check"]
    assert subprocess.run([*check, str(PATCHES / "core_v0.16.1" / "PINNED_FILES.sha256")], cwd=mlm).returncode == 0
    res = run_script(mlm)
    assert res.returncode == 0, res.stderr
    patched = (mlm / "pretrain_gpt.py").read_text()
    ast.parse(patched)  # still valid Python
    assert patched != original and "_wlb.apply(middle_stage_batches=True)" in patched
    assert git(mlm, "status", "--porcelain", "--untracked-files=no") == "M pretrain_gpt.py"
    again = run_script(mlm)
    assert again.returncode == 0 and "already applied" in again.stdout
    assert (mlm / "pretrain_gpt.py").read_text() == patched
    assert subprocess.run([*check, str(PATCHES / "core_v0.16.1" / "PATCHED_FILES.sha256")], cwd=mlm).returncode == 0
    # the hook is guarded: without --wlb-* flags or WLB_ENABLE nothing of ours is imported
    tree = ast.parse(patched)
    guards = [n for n in ast.walk(tree) if isinstance(n, ast.If) and "WLB_ENABLE" in ast.unparse(n.test)]
    assert len(guards) == 1 and "--wlb-" in ast.unparse(guards[0].test)
    # and it runs: import the patched pretrain_gpt with a --wlb-* flag, then drive its own get_batch
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(mlm), str(ROOT)])}
    res = subprocess.run([sys.executable, "-W", "ignore", "-c", _DRIVE_GET_BATCH], cwd=mlm, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "get_batch OK" in res.stdout
    # without megatron_wlb importable (blocked via sys.modules), asking for WLB-LLM fails with a clear message
    block = "import sys; sys.modules['megatron_wlb'] = None; sys.argv = ['pretrain_gpt.py'{}]; import pretrain_gpt"
    res = subprocess.run([sys.executable, "-W", "ignore", "-c", block.format(", '--wlb-packer', 'wlb'")], cwd=mlm,
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "megatron_wlb is not importable" in res.stderr and "pip install -e" in res.stderr
    stock = block.format("") + "; assert pretrain_gpt._wlb is None"
    res = subprocess.run([sys.executable, "-W", "ignore", "-c", stock], cwd=mlm, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr  # no --wlb-* flag: stock Megatron behaviour, megatron_wlb not needed


# Runs inside the patched checkout: the first/last-stage THD path and the middle-stage path of the pinned
# pretrain_gpt.get_batch, with Megatron's arg/config/stage helpers stubbed (no GPU, no parsed args).
_DRIVE_GET_BATCH = """
import sys
sys.argv = ["pretrain_gpt.py", "--wlb-cp-sharding", "per-document"]
import numpy as np, torch
import pretrain_gpt as pg
assert pg._wlb is not None, "the --wlb-* flag did not turn the hook on"
from megatron_wlb.megatron.hooks import cp_hooks
from megatron_wlb.megatron.args.settings import WlbSettings
cp_hooks.install(WlbSettings(cp_sharding="per-document"))
from megatron_wlb.megatron.hooks import table as hooks
assert hooks.hooks_in(pg.get_thd_batch_on_this_cp_rank) == ["get_thd_batch_on_this_cp_rank"]
pg.get_args = lambda: None
pg.core_transformer_config_from_args = lambda args: None
pg.mtp_on_this_rank = lambda *a, **k: False
from megatron_wlb.cp.plan import CPSharding
from megatron_wlb.megatron import pinned_tp_rank_batch
from megatron_wlb.megatron.data.packed import rank_micro_batch
from megatron_wlb.packing.types import DocPiece, MicroBatch
lengths = [5, 1, 9]
T = sum(lengths)
mb = MicroBatch(tuple(DocPiece(i, 0, n, 0) for i, n in enumerate(lengths)), capacity=32)
batch = rank_micro_batch(lambda doc, offset, n: np.arange(offset, offset + n) + 100 * doc, mb,
                         CPSharding("per-document"))
pg.get_batch_on_this_tp_rank = lambda it, mtp_on_this_rank=False: pinned_tp_rank_batch(next(it))
pg.is_first_or_last_pipeline_stage = lambda vp_stage=None: True
tokens, labels, loss_mask, attention_mask, position_ids, params = pg.get_batch(iter([batch]))
assert isinstance(params, cp_hooks.WlbPackedSeqParams) and params.gather.layout == "per-document"
assert tokens.tolist() == batch.tokens.tolist() and position_ids.tolist() == batch.position_ids.tolist()
assert labels.tolist() == batch.labels.tolist() and attention_mask is None
pg.is_first_or_last_pipeline_stage = lambda vp_stage=None: False
out = pg.get_batch(iter([batch]))
assert out[:5] == (None,) * 5
assert torch.equal(out[5].gather.segment_index, params.gather.segment_index)
print("get_batch OK")
"""


# ---------------------------------------------------------------------------------------------------
# launchers: the generated SLURM scripts and the single-node launcher
# ---------------------------------------------------------------------------------------------------

SLURM = ROOT / "scripts" / "slurm"


def _flag(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, f"{name} appears {argv.count(name)} times in {argv}"
    return argv[argv.index(name) + 1]


def _fake_cluster(tmp_path: Path) -> tuple[dict, Path]:
    """Two nodes: conftest's stub cluster environment and the file srun records into."""
    return conftest.fake_cluster(tmp_path)


def test_generated_sbatch_scripts_are_current_and_parse():
    from megatron_wlb.config import list_configs

    res = subprocess.run([sys.executable, str(SLURM / "make_sbatch.py"), "--check"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    scripts = sorted(p.stem for p in SLURM.glob("*.sbatch"))
    assert scripts == list_configs()  # one script per configs/*.yaml, none extra
    for name in scripts:
        res = subprocess.run(["bash", "-n", str(SLURM / f"{name}.sbatch")], capture_output=True, text=True)
        assert res.returncode == 0, f"{name}: {res.stderr}"


@pytest.mark.parametrize("name", ["550m_64k", "7b_128k", "70b_64k", "405b_128k_8k"])
def test_sbatch_runs_torchrun_with_the_config_layout(tmp_path: Path, name: str):
    """Run the generated script under a fake SLURM: srun gets torchrun with the config's layout."""
    from megatron_wlb.config import load_config

    run = load_config(name)
    lay = run.layout
    text = (SLURM / f"{name}.sbatch").read_text()
    nodes = int(re.search(r"^#SBATCH --nodes=(\d+)$", text, re.M).group(1))
    gpn = int(re.search(r"^#SBATCH --gpus-per-node=(\d+)$", text, re.M).group(1))
    assert nodes * gpn == lay.world_size == lay.tp * lay.cp * lay.pp * lay.dp
    env, record = _fake_cluster(tmp_path)
    env["SLURM_NNODES"] = str(nodes)
    res = subprocess.run(["bash", str(SLURM / f"{name}.sbatch")], env=env, capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    argv = record.read_text().splitlines()
    assert argv[0] == "srun" and "torchrun" in argv
    assert _flag(argv, "--nnodes") == str(nodes) and _flag(argv, "--nproc-per-node") == str(gpn)
    assert _flag(argv, "--rdzv-endpoint").startswith("node-a:")
    assert _flag(argv, "--tensor-model-parallel-size") == str(lay.tp)
    assert _flag(argv, "--context-parallel-size") == str(lay.cp)
    assert _flag(argv, "--pipeline-model-parallel-size") == str(lay.pp)
    assert _flag(argv, "--global-batch-size") == str(run.micro_batches * lay.dp)  # DP = world / (TP*CP*PP)
    assert _flag(argv, "--micro-batch-size") == "1"
    assert _flag(argv, "--num-layers") == str(run.model.num_layers)
    assert _flag(argv, "--hidden-size") == str(run.model.hidden)
    assert _flag(argv, "--seq-length") == str(run.seq_len)
    assert _flag(argv, "--wlb-config") == name
    assert ("--num-query-groups" in argv) == (run.model.num_kv_heads != run.model.num_heads)
    data = argv[argv.index("--data-path") + 1: argv.index("--data-path") + 5]
    assert data == ["0.3", "/data/a_text_document", "0.7", "/data/b_text_document"]  # blends split into words
    assert argv[argv.index("torchrun") + 1:].count(str(Path(env["MEGATRON_LM"]) / "pretrain_gpt.py")) == 1


def test_sbatch_refuses_wrong_node_count_and_unpatched_checkout(tmp_path: Path):
    env, record = _fake_cluster(tmp_path)
    script = str(SLURM / "7b_64k.sbatch")  # 32 GPUs = 4 nodes x 8
    res = subprocess.run(["bash", script], env={**env, "SLURM_NNODES": "2"}, capture_output=True, text=True,
                         cwd=tmp_path)
    assert res.returncode == 1 and "32 GPUs" in res.stderr and "2 node(s)" in res.stderr
    (Path(env["MEGATRON_LM"]) / "pretrain_gpt.py").write_text("# unpatched\n")
    res = subprocess.run(["bash", script], env={**env, "SLURM_NNODES": "4"}, capture_output=True, text=True,
                         cwd=tmp_path)
    assert res.returncode == 1 and "apply_patches.sh" in res.stderr
    unset = {k: v for k, v in env.items() if k != "DATA_PATH"}
    res = subprocess.run(["bash", script], env={**unset, "SLURM_NNODES": "4"}, capture_output=True, text=True,
                         cwd=tmp_path)
    assert res.returncode != 0 and "DATA_PATH" in res.stderr
    assert not record.exists()  # srun never ran


def test_launch_local_scales_the_layout_to_one_node(tmp_path: Path):
    env, _ = _fake_cluster(tmp_path)
    env.update(NPROC="8", TP="2", CP="2", PP="1", DRY_RUN="1")
    res = subprocess.run(["bash", str(ROOT / "scripts" / "launch_local.sh"), "7b_64k", "--wlb-cp-sharding",
                          "hybrid"], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    argv = res.stdout.split()
    assert argv[0] == "torchrun" and _flag(argv, "--nproc-per-node") == "8"
    assert _flag(argv, "--tensor-model-parallel-size") == "2" and _flag(argv, "--context-parallel-size") == "2"
    assert _flag(argv, "--pipeline-model-parallel-size") == "1"
    assert _flag(argv, "--global-batch-size") == "8"  # 4 micro-batches x DP 2
    # not the config's layout: its packing choices as flags (tests/test_cli_launch.py runs the start-up check)
    assert "--wlb-config" not in argv and argv[-2:] == ["--wlb-cp-sharding", "hybrid"]
    env.update(NPROC="6", TP="4", CP="", PP="")
    res = subprocess.run(["bash", str(ROOT / "scripts" / "launch_local.sh"), "7b_64k"], env=env,
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert res.returncode == 1 and "not a multiple of TP*CP*PP" in res.stderr


def test_launch_local_on_a_bare_gpu_machine(tmp_path: Path):
    """No TOKENIZER_MODEL, no TransformerEngine, no nvidia-smi (issue 20, item 6): NullTokenizer with
    --vocab-size, the local transformer, and the GPU count from torch (a stand-in answering 1)."""
    env, _ = _fake_cluster(tmp_path)
    env.pop("TOKENIZER_MODEL")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import torch\ntorch.cuda.device_count = lambda: 1\n")
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "transformer_engine.py").write_text("raise ImportError('not installed here')\n")
    (blocked / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")
    (blocked / "nvidia-smi").chmod(0o755)
    env.update(DRY_RUN="1", PATH=f"{blocked}:{env['PATH']}",
               PYTHONPATH=os.pathsep.join([str(site), str(blocked), env["PYTHONPATH"]]))
    env.pop("NPROC", None)
    env.pop("TRANSFORMER_IMPL", None)
    res = subprocess.run(["bash", str(ROOT / "scripts" / "launch_local.sh"), "7b_64k"], env=env, capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    argv = res.stdout.split()
    assert _flag(argv, "--nproc-per-node") == "1" and _flag(argv, "--tokenizer-type") == "NullTokenizer"
    assert _flag(argv, "--vocab-size") == "32000" and "--tokenizer-model" not in argv
    assert _flag(argv, "--transformer-impl") == "local" and "--no-persist-layer-norm" in argv


def test_gpu_smoke_script_parses():
    res = subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_smoke_train.sh")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


_PARSE_WITH_MEGATRON = """
import json, sys
from megatron.training.arguments import parse_args
from megatron_wlb.megatron.args.flags import wlb_extra_args_provider
argvs = json.load(open(sys.argv[1]))
for argv in argvs:
    sys.argv = ["pretrain_gpt.py", *argv]
    args = parse_args(extra_args_provider=wlb_extra_args_provider(None))
    assert args.wlb_config or args.wlb_packer, argv
print("parsed", len(argvs))
# the one-GPU smoke recipe (TP = CP = PP = 1) also passes Megatron's validate_args and ours, which
# installs the CP hooks; it needs its dataset, so write a small one from the standard library
import sysconfig
from pathlib import Path
import megatron_wlb.megatron as wlb
from megatron_wlb.megatron.hooks import cp_hooks
from megatron_wlb.data.reader import byte_documents, write_indexed_dataset
smoke = argvs[-1]
prefix = smoke[smoke.index("--data-path") + 1]
Path(prefix).parent.mkdir(parents=True, exist_ok=True)
files = sorted(str(p) for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]
write_indexed_dataset(prefix, byte_documents(files, separator=None))
wlb.apply()
from megatron.training import arguments
sys.argv = ["pretrain_gpt.py", *smoke]
args = arguments.validate_args(arguments.parse_args(), {})
assert cp_hooks._installed().settings.cp_sharding == "per-document"
print("validated smoke")
"""


@needs_mirror
@pytest.mark.slow
def test_launcher_flags_parse_with_megatrons_parser(pinned_checkout: Path, tmp_path: Path):
    """Every flag the launchers pass exists in the pinned Megatron-LM's parser (or ours): the sbatch
    scripts of all configs, the single-node launcher and the GPU smoke recipe."""
    import json

    from megatron_wlb.config import list_configs, load_config

    argvs = []
    env, record = _fake_cluster(tmp_path)
    script_arg = str(Path(env["MEGATRON_LM"]) / "pretrain_gpt.py")
    for name in list_configs():
        nodes = load_config(name).layout.world_size // 8
        res = subprocess.run(["bash", str(SLURM / f"{name}.sbatch")], env={**env, "SLURM_NNODES": str(nodes)},
                             capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        argv = record.read_text().splitlines()
        argvs.append(argv[argv.index(script_arg) + 1:])
    res = subprocess.run(["bash", str(ROOT / "scripts" / "launch_local.sh"), "7b_64k"], capture_output=True,
                         text=True, timeout=60, cwd=tmp_path, env={**env, "NPROC": "8", "TP": "2", "CP": "2",
                                                                  "PP": "2", "DRY_RUN": "1"})
    assert res.returncode == 0, res.stderr
    words = res.stdout.split()
    argvs.append(words[words.index(script_arg) + 1:])
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_smoke_train.sh"), str(tmp_path / "smoke")],
                         env={**env, "PRINT_ARGS": "1"}, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    argvs.append(res.stdout.splitlines())
    (tmp_path / "argvs.json").write_text(json.dumps(argvs))
    res = subprocess.run([sys.executable, "-W", "ignore", "-c", _PARSE_WITH_MEGATRON, str(tmp_path / "argvs.json")],
                         cwd=pinned_checkout, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(pinned_checkout), str(ROOT)])})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"parsed {len(list_configs()) + 2}" in res.stdout and "validated smoke" in res.stdout


def test_sbatch_without_a_checkout_runs_our_launcher(tmp_path: Path):
    """The README's 0.19 route on a cluster: no MEGATRON_LM, so srun starts torchrun on our launcher."""
    env, record = _fake_cluster(tmp_path)
    del env["MEGATRON_LM"]
    res = subprocess.run(["bash", str(SLURM / "550m_64k.sbatch")], env={**env, "SLURM_NNODES": "4"},
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    argv = record.read_text().splitlines()
    at = argv.index("torchrun")
    assert argv[argv.index("-m", at) + 1] == "megatron_wlb.megatron.entry.launcher"
    assert not any(a.endswith("pretrain_gpt.py") for a in argv)
    assert _flag(argv, "--wlb-config") == "550m_64k"


def test_make_sbatch_writes_a_script_for_the_users_own_config(tmp_path: Path):
    """make_sbatch.py CONFIG.yaml --out FILE: a script for a YAML of the user's (here a copy of a shipped
    one with another name and DP), naming that YAML in --wlb-config and the layout in its flags."""
    import yaml

    from megatron_wlb.config import CONFIG_DIR

    config = yaml.safe_load((Path(str(CONFIG_DIR)) / "550m_64k.yaml").read_text())
    config["name"] = "my_run"
    config["layout"]["dp"] = 4
    mine = tmp_path / "my_run.yaml"
    mine.write_text(yaml.safe_dump(config))
    out = tmp_path / "jobs" / "my_run.sbatch"
    res = subprocess.run([sys.executable, str(SLURM / "make_sbatch.py"), str(mine), "--out", str(out)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    text = out.read_text()
    assert f"from {mine}" in text and "#SBATCH --nodes=8" in text  # TP2 CP2 PP4 DP4 = 64 GPUs
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0
    env, record = _fake_cluster(tmp_path)
    res = subprocess.run(["bash", str(out)], env={**env, "SLURM_NNODES": "8"}, capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    argv = record.read_text().splitlines()
    assert _flag(argv, "--wlb-config") == str(mine) and _flag(argv, "--global-batch-size") == str(4 * 4)
    bad = subprocess.run([sys.executable, str(SLURM / "make_sbatch.py"), str(mine)], capture_output=True, text=True)
    assert bad.returncode == 2 and "--out" in bad.stderr


@pytest.mark.slow
def test_sbatch_cpu_mode_trains_through_the_cpu_harness(tmp_path: Path):
    """WLB_CPU=1: a shipped script, run as SLURM runs it (srun executing its command on this node, the job's
    node list from scontrol), trains the tiny GPT through Megatron's loop and logs the [wlb] lines."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "srun").write_text('#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\nexec "$@"\n')
    (bindir / "scontrol").write_text("#!/bin/bash\necho localhost\n")
    for stub in ("srun", "scontrol"):
        (bindir / stub).chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT), "PYTHON": sys.executable, "WLB_CPU": "1", "SLURM_NNODES": "1",
           "SLURM_JOB_ID": "4243", "SLURM_JOB_NODELIST": "localhost", "LOG_DIR": str(tmp_path / "logs"),
           "CKPT_DIR": str(tmp_path / "ckpt"), "WLB_CPU_NPROC_PER_NODE": "2"}
    env.pop("MEGATRON_LM", None)
    res = subprocess.run(["bash", str(SLURM / "550m_64k.sbatch")], env=env, capture_output=True, text=True,
                         timeout=400, cwd=tmp_path)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    assert "(CPU mode): 1 node(s) x 2 process(es), DP=2" in log
    assert "iteration        4/       4" in log and log.count("[wlb] iteration") >= 4
