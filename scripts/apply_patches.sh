#!/usr/bin/env bash
# Apply megatron-wlb's patches to a Megatron-LM checkout.
#
#   scripts/apply_patches.sh /path/to/Megatron-LM
#
# - patches/<tag>/ holds one supported release's patches and its pinned commit (PINNED_COMMIT):
#   core_v0.16.1 and core_v0.19.0. The checkout must be a git work tree whose HEAD is one of those
#   commits; any other commit is refused, naming each supported one and the launcher route
#   (python -m megatron_wlb.megatron.entry.launcher), which needs no checkout.
# - Tracked files must be unmodified (untracked files are ignored), except for exactly the changes
#   our patches make: running the script again on a patched checkout is a no-op (idempotent).
# - Patches are applied with `git apply` after a `git apply --check` of all of them (all or nothing).
# - A tree that is not a git work tree (an exported copy, a staged kit, a machine without git) is
#   identified by content instead: every file the patches touch must match a release's
#   PINNED_FILES.sha256 (its pinned commit's files) or, already patched, its PATCHED_FILES.sha256 (every
#   release ships both, written and checked by scripts/patch_manifests.py from the pinned commit); a
#   pinned tree is patched with `git apply` (it works outside a repository) or else `patch -p1`.
# Environment: WLB_PATCHES_DIR overrides the patches folder (tests use it): either one release's folder
# (PINNED_COMMIT + *.patch) or a folder of them; exit status 0 on success or "already applied", 1 on
# any refusal.
set -euo pipefail

die() { echo "apply_patches.sh: error: $*" >&2; exit 1; }

[[ $# -eq 1 ]] || die "usage: $0 /path/to/Megatron-LM (a git checkout of a supported release's pinned commit)"
target=$1
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
patches_root=${WLB_PATCHES_DIR:-$here/../patches}
[[ -d $patches_root ]] || die "patches folder not found: $patches_root"
shopt -s nullglob
if [[ -f $patches_root/PINNED_COMMIT ]]; then
    releases=("$patches_root")
else
    releases=()
    for pin in "$patches_root"/*/PINNED_COMMIT; do releases+=("$(dirname "$pin")"); done
fi
shopt -u nullglob
(( ${#releases[@]} > 0 )) || die "no PINNED_COMMIT in $patches_root or its folders"
for release in "${releases[@]}"; do
    pin=$(tr -d '[:space:]' < "$release/PINNED_COMMIT")
    [[ $pin =~ ^[0-9a-f]{40}$ ]] || die "$release/PINNED_COMMIT must hold one full 40-hex commit, got '$pin'"
done

have_git() { git --version >/dev/null 2>&1; }

# Files "sha256  path" in a manifest all match under $1?
matches() { (cd "$1" && sha256sum --quiet --check --status "$2") 2>/dev/null; }

# A tree without git: identify it by the content of the files a release's patches touch.
apply_by_content() {
    local tree=$1 release p found=""
    command -v sha256sum >/dev/null 2>&1 || die "$tree is not a git checkout and sha256sum is missing (coreutils)"
    for release in "${releases[@]}"; do
        [[ -f $release/PINNED_FILES.sha256 && -f $release/PATCHED_FILES.sha256 ]] || continue
        found=1
        local pinned_commit patches_of=("$release"/*.patch)
        pinned_commit=$(tr -d '[:space:]' < "$release/PINNED_COMMIT")
        if matches "$tree" "$release/PATCHED_FILES.sha256"; then
            echo "apply_patches.sh: already applied to $tree ($(basename "$release"), identified by content); nothing to do"
            return
        fi
        matches "$tree" "$release/PINNED_FILES.sha256" || continue
        if have_git; then
            export GIT_CEILING_DIRECTORIES=$(dirname "$tree")  # never the work tree of a repository around it
            for p in "${patches_of[@]}"; do (cd "$tree" && git apply --check "$p") || die "$(basename "$p") does not apply to $tree"; done
            for p in "${patches_of[@]}"; do (cd "$tree" && git apply "$p"); echo "apply_patches.sh: applied $(basename "$p")"; done
        elif command -v patch >/dev/null 2>&1; then
            for p in "${patches_of[@]}"; do patch -d "$tree" -p1 --dry-run -s -f < "$p" >/dev/null || die "$(basename "$p") does not apply to $tree"; done
            for p in "${patches_of[@]}"; do patch -d "$tree" -p1 -s -f < "$p"; echo "apply_patches.sh: applied $(basename "$p")"; done
        else
            die "$tree is not a git checkout and neither git nor patch is installed: apply the patches elsewhere (scripts/gpu_stage.sh ships a patched tree)"
        fi
        matches "$tree" "$release/PATCHED_FILES.sha256" || die "patched $tree, but the result differs from $release/PATCHED_FILES.sha256"
        echo "apply_patches.sh: $tree patched for WLB-LLM ($(basename "$release"), pinned $pinned_commit, identified by content)"
        return
    done
    [[ -n $found ]] || die "$tree is not a git checkout and no release in $patches_root has PINNED_FILES.sha256 / PATCHED_FILES.sha256 to identify it by"
    die "$tree is not a git checkout and its files match no supported release's pinned or patched files:
  use a copy of a supported release's pinned commit, or a git checkout of it;
  or run our launcher, which needs no checkout: torchrun ... -m megatron_wlb.megatron.entry.launcher <flags>"
}

[[ -d $target ]] || die "$target is not a directory"
target=$(cd "$target" && pwd -P)
if ! have_git || [[ $(git -C "$target" rev-parse --show-toplevel 2>/dev/null) != "$target" ]]; then
    apply_by_content "$target"
    exit 0
fi
top=$(git -C "$target" rev-parse --show-toplevel)
head=$(git -C "$target" rev-parse HEAD 2>/dev/null) || die "$target has no commits"
patches_dir=""
for release in "${releases[@]}"; do
    if [[ $(tr -d '[:space:]' < "$release/PINNED_COMMIT") == "$head" ]]; then patches_dir=$release; fi
done
if [[ -z $patches_dir ]]; then
    fixes=""
    for release in "${releases[@]}"; do
        fixes+="
  Fix: git -C '$top' checkout $(tr -d '[:space:]' < "$release/PINNED_COMMIT")   ($(basename "$release"))"
    done
    die "$top is at commit $head, but the patches are for other commits:$fixes
  Or run our launcher, which needs no checkout: torchrun ... -m megatron_wlb.megatron.entry.launcher <flags>"
fi
pinned=$head
shopt -s nullglob
patches=("$patches_dir"/*.patch)
shopt -u nullglob
(( ${#patches[@]} > 0 )) || die "no *.patch files in $patches_dir"

# Files our patches touch, and the tracked files that differ from HEAD.
touched=$(for p in "${patches[@]}"; do git -C "$top" apply --numstat "$p" | cut -f3; done | sort -u)
dirty=$(git -C "$top" status --porcelain --untracked-files=no | cut -c4- | sort -u)

# Already applied? Every patch reverses cleanly and nothing else is modified.
applied=0
for p in "${patches[@]}"; do
    if git -C "$top" apply --reverse --check "$p" >/dev/null 2>&1; then applied=$((applied + 1)); fi
done
if (( applied == ${#patches[@]} )); then
    extra=$(comm -23 <(printf '%s\n' "$dirty" | sed '/^$/d') <(printf '%s\n' "$touched" | sed '/^$/d'))
    [[ -z $extra ]] || die "the patches are applied but $top has other modified files:
$extra
  Commit or revert those changes first."
    echo "apply_patches.sh: already applied to $top (${#patches[@]} patch(es)); nothing to do"
    exit 0
fi
if (( applied > 0 )); then
    die "$top is partly patched ($applied of ${#patches[@]} patches applied).
  Revert them (git -C '$top' checkout -- .) and run this script again."
fi
if [[ -n $dirty ]]; then
    die "$top has modified tracked files:
$dirty
  The patches apply only to a clean checkout: commit, or revert with git -C '$top' checkout -- <file>."
fi

for p in "${patches[@]}"; do
    git -C "$top" apply --check "$p" 2>&1 || die "$(basename "$p") does not apply to $top"
done
for p in "${patches[@]}"; do
    git -C "$top" apply "$p"
    echo "apply_patches.sh: applied $(basename "$p")"
done
echo "apply_patches.sh: $top patched for WLB-LLM ($(basename "$patches_dir"), pinned $pinned); see docs/megatron_launch.md"
