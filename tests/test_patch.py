"""scripts/apply_patches.sh: its checks on a tiny synthetic git repo (always), and the real patch on a
checkout of the pinned Megatron-LM commit materialised from a local mirror (when one is present).

The mirror is looked up at $WLB_MEGATRON_MIRROR, else /work/.mirror/NVIDIA+Megatron-LM/repo (where this
project's tooling fetches it); CI has none, so that test skips there and the synthetic ones carry the
logic (wrong commit refused, dirty tree refused, clean apply, idempotent second run).
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "apply_patches.sh"
PATCHES = ROOT / "patches"
PINNED = (PATCHES / "PINNED_COMMIT").read_text().strip()
MIRROR = Path(os.environ.get("WLB_MEGATRON_MIRROR", "/work/.mirror/NVIDIA+Megatron-LM/repo"))

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


def test_shipped_pin_and_patch_are_consistent():
    """The shipped pin is a full sha, version.py names the same commit, the patch touches pretrain_gpt.py."""
    assert len(PINNED) == 40 and all(c in "0123456789abcdef" for c in PINNED)
    version = (ROOT / "megatron_wlb" / "megatron" / "version.py").read_text()
    assert f'PINNED_MEGATRON_COMMIT = "{PINNED}"' in version
    patch = (PATCHES / "pretrain_gpt_wlb.patch").read_text()
    assert "+++ b/pretrain_gpt.py" in patch
    for hook in ("_wlb.apply()", "packed_seq_params_from_iterator"):
        assert hook in patch
    # the functions the patch calls exist in megatron_wlb under those names (read, not imported: fast)
    defined = {n.name for n in ast.walk(ast.parse((ROOT / "megatron_wlb/megatron/cp_hooks.py").read_text()))
               if isinstance(n, ast.FunctionDef)}
    assert "packed_seq_params_from_iterator" in defined


def _mirror_has_pin() -> bool:
    if not (MIRROR / "HEAD").exists() and not (MIRROR / ".git").exists():
        return False
    res = subprocess.run(["git", "--git-dir", str(MIRROR), "cat-file", "-e", f"{PINNED}^{{commit}}"],
                         capture_output=True)
    return res.returncode == 0


@pytest.mark.skipif(not _mirror_has_pin(), reason=f"no Megatron-LM mirror holding {PINNED[:12]} at {MIRROR} "
                    "(set WLB_MEGATRON_MIRROR); the synthetic-repo tests cover the script's logic")
def test_real_patch_on_pinned_checkout(tmp_path: Path):
    """Materialise the pinned commit from the mirror (shared clone, nothing copied into this repo)."""
    mlm = tmp_path / "Megatron-LM"
    subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", str(MIRROR), str(mlm)], check=True,
                   timeout=300)
    git(mlm, "checkout", "-q", "--detach", PINNED)
    original = (mlm / "pretrain_gpt.py").read_text()
    res = run_script(mlm)
    assert res.returncode == 0, res.stderr
    patched = (mlm / "pretrain_gpt.py").read_text()
    ast.parse(patched)  # still valid Python
    assert patched != original and "_wlb.apply()" in patched
    assert git(mlm, "status", "--porcelain", "--untracked-files=no") == "M pretrain_gpt.py"
    again = run_script(mlm)
    assert again.returncode == 0 and "already applied" in again.stdout
    assert (mlm / "pretrain_gpt.py").read_text() == patched
    # the hook is guarded: without --wlb-* flags or WLB_ENABLE nothing of ours is imported
    tree = ast.parse(patched)
    guards = [n for n in ast.walk(tree) if isinstance(n, ast.If) and "WLB_ENABLE" in ast.unparse(n.test)]
    assert len(guards) == 1 and "--wlb-" in ast.unparse(guards[0].test)
