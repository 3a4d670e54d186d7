#!/usr/bin/env python3
"""Write, or check, every supported release's content manifests (patches/<tag>/PINNED_FILES.sha256 and
PATCHED_FILES.sha256) from its pinned commit.

    python scripts/patch_manifests.py /path/to/Megatron-LM            # (re)write them
    python scripts/patch_manifests.py /path/to/Megatron-LM --check    # exit 1 if a shipped one is missing or stale

The Megatron-LM git repository (a checkout or a bare mirror) must hold each ``patches/<tag>/PINNED_COMMIT``.
``scripts/apply_patches.sh`` identifies a tree without ``.git`` by these manifests: the sha256 of every file the
release's patches touch, at the pinned commit (PINNED) and after its patches (PATCHED).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

PATCHES = Path(__file__).resolve().parents[1] / "patches"
MANIFESTS = ("PINNED_FILES.sha256", "PATCHED_FILES.sha256")


def touched_files(release: Path) -> list[str]:
    """The files a release's patches write (their ``+++ b/`` paths), sorted."""
    text = "".join(p.read_text() for p in sorted(release.glob("*.patch")))
    return sorted(set(re.findall(r"^\+\+\+ b/(\S+)", text, re.M)))


def _manifest(tree: Path, paths: list[str]) -> str:
    return "".join(f"{hashlib.sha256((tree / p).read_bytes()).hexdigest()}  {p}\n" for p in paths)


def manifests(release: Path, repo: str) -> dict[str, str]:
    """{manifest name: text} of one release, computed from its pinned commit in ``repo``."""
    pin = (release / "PINNED_COMMIT").read_text().strip()
    paths = touched_files(release)
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp)
        for path in paths:
            shown = subprocess.run(["git", "-C", repo, "show", f"{pin}:{path}"], capture_output=True)
            if shown.returncode:
                raise SystemExit(f"patch_manifests.py: error: {repo} does not hold {pin[:12]}:{path} "
                                 f"({release.name}): use a Megatron-LM repository that has the pinned commit")
            (tree / path).parent.mkdir(parents=True, exist_ok=True)
            (tree / path).write_bytes(shown.stdout)
        pinned = _manifest(tree, paths)
        for patch in sorted(release.glob("*.patch")):
            subprocess.run(["git", "apply", str(patch)], cwd=tree, check=True,
                           env={**os.environ, "GIT_CEILING_DIRECTORIES": tmp})
        return {"PINNED_FILES.sha256": pinned, "PATCHED_FILES.sha256": _manifest(tree, paths)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("repo", help="a Megatron-LM git checkout or mirror holding every pinned commit")
    parser.add_argument("--check", action="store_true", help="exit 1 if a shipped manifest is missing or stale")
    opts = parser.parse_args(argv)
    stale = []
    for release in sorted(p.parent for p in PATCHES.glob("*/PINNED_COMMIT")):
        for name, text in manifests(release, opts.repo).items():
            path = release / name
            if opts.check:
                if not path.is_file() or path.read_text() != text:
                    stale.append(str(path))
            elif not path.is_file() or path.read_text() != text:
                path.write_text(text)
                print(f"wrote {path}")
    if stale:
        print("patch_manifests.py: stale or missing (run scripts/patch_manifests.py REPO): " + ", ".join(stale),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
