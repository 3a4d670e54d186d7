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

[[ -d $target ]] || die "$target is not a directory"
git -C "$target" rev-parse --is-inside-work-tree >/dev/null 2>&1 \
    || die "$target is not a git checkout; clone Megatron-LM and check out $pinned first"
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
