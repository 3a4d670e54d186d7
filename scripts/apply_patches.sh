#!/usr/bin/env bash
# Apply megatron-wlb's patches (patches/*.patch) to a Megatron-LM checkout.
#
#   scripts/apply_patches.sh /path/to/Megatron-LM
#
# - The checkout must be a git work tree whose HEAD is the pinned commit (patches/PINNED_COMMIT,
#   Megatron-LM core_v0.16.1); any other commit is refused, with the command that fixes it.
# - Tracked files must be unmodified (untracked files are ignored), except for exactly the changes
#   our patches make: running the script again on a patched checkout is a no-op (idempotent).
# - Patches are applied with `git apply` after a `git apply --check` of all of them (all or nothing).
# - A tree that is not a git work tree (an exported copy, a staged kit, a machine without git) is
#   identified by content instead: every file the patches touch must match patches/PINNED_FILES.sha256
#   (the pinned commit's files) or, already patched, patches/PATCHED_FILES.sha256; a pinned tree is
#   patched with `git apply` (it works outside a repository) or else `patch -p1`.
# Environment: WLB_PATCHES_DIR overrides the patches folder (tests use it); exit status 0 on success
# or "already applied", 1 on any refusal.
set -euo pipefail

die() { echo "apply_patches.sh: error: $*" >&2; exit 1; }

[[ $# -eq 1 ]] || die "usage: $0 /path/to/Megatron-LM (a git checkout of the pinned commit)"
target=$1
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
patches_dir=${WLB_PATCHES_DIR:-$here/../patches}
[[ -d $patches_dir ]] || die "patches folder not found: $patches_dir"
[[ -f $patches_dir/PINNED_COMMIT ]] || die "$patches_dir/PINNED_COMMIT is missing"
pinned=$(tr -d '[:space:]' < "$patches_dir/PINNED_COMMIT")
[[ $pinned =~ ^[0-9a-f]{40}$ ]] || die "$patches_dir/PINNED_COMMIT must hold one full 40-hex commit, got '$pinned'"
shopt -s nullglob
patches=("$patches_dir"/*.patch)
shopt -u nullglob
(( ${#patches[@]} > 0 )) || die "no *.patch files in $patches_dir"

have_git() { git --version >/dev/null 2>&1; }

# Files "sha256  path" in a manifest all match under $1?
matches() { (cd "$1" && sha256sum --quiet --check --status "$2") 2>/dev/null; }

# A tree without git: identify it by the content of the files the patches touch.
apply_by_content() {
    local tree=$1 p
    local unpatched=$patches_dir/PINNED_FILES.sha256 patched=$patches_dir/PATCHED_FILES.sha256
    [[ -f $unpatched && -f $patched ]] \
        || die "$tree is not a git checkout and $patches_dir has no PINNED_FILES.sha256 / PATCHED_FILES.sha256 to identify it by"
    command -v sha256sum >/dev/null 2>&1 || die "$tree is not a git checkout and sha256sum is missing (coreutils)"
    if matches "$tree" "$patched"; then
        echo "apply_patches.sh: already applied to $tree (${#patches[@]} patch(es), identified by content); nothing to do"
        return
    fi
    matches "$tree" "$unpatched" || die "$tree is not a git checkout and its files differ from the pinned commit $pinned
  (and from its patched state): use a copy of Megatron-LM $pinned (core_v0.16.1), or a git checkout of it"
    if have_git; then
        export GIT_CEILING_DIRECTORIES=$(dirname "$tree")  # never the work tree of a repository around it
        for p in "${patches[@]}"; do (cd "$tree" && git apply --check "$p") || die "$(basename "$p") does not apply to $tree"; done
        for p in "${patches[@]}"; do (cd "$tree" && git apply "$p"); echo "apply_patches.sh: applied $(basename "$p")"; done
    elif command -v patch >/dev/null 2>&1; then
        for p in "${patches[@]}"; do patch -d "$tree" -p1 --dry-run -s -f < "$p" >/dev/null || die "$(basename "$p") does not apply to $tree"; done
        for p in "${patches[@]}"; do patch -d "$tree" -p1 -s -f < "$p"; echo "apply_patches.sh: applied $(basename "$p")"; done
    else
        die "$tree is not a git checkout and neither git nor patch is installed: apply the patches elsewhere (scripts/gpu_stage.sh ships a patched tree)"
    fi
    matches "$tree" "$patched" || die "patched $tree, but the result differs from PATCHED_FILES.sha256"
    echo "apply_patches.sh: $tree patched for WLB-LLM (pinned $pinned, identified by content)"
}

[[ -d $target ]] || die "$target is not a directory"
target=$(cd "$target" && pwd -P)
if ! have_git || [[ $(git -C "$target" rev-parse --show-toplevel 2>/dev/null) != "$target" ]]; then
    apply_by_content "$target"
    exit 0
fi
top=$(git -C "$target" rev-parse --show-toplevel)
head=$(git -C "$target" rev-parse HEAD 2>/dev/null) || die "$target has no commits"
if [[ $head != "$pinned" ]]; then
    die "$top is at commit $head, but the patches are for $pinned (Megatron-LM core_v0.16.1).
  Fix: git -C '$top' checkout $pinned   (or git -C '$top' checkout core_v0.16.1)"
fi

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
echo "apply_patches.sh: $top patched for WLB-LLM (pinned $pinned); see docs/megatron_launch.md"
