#!/usr/bin/env bash
# Apply megatron-wlb's patches to a Megatron-LM checkout.
#
#   scripts/apply_patches.sh /path/to/Megatron-LM
#
# - patches/<tag>/ holds one supported release's patches and its pinned commit (PINNED_COMMIT):
#   core_v0.16.1 and core_v0.19.0. The checkout must be a git work tree whose HEAD is one of those
#   commits; any other commit is refused, naming each supported one and the launcher route
#   (python -m megatron_wlb.megatron.launcher), which needs no checkout.
# - Tracked files must be unmodified (untracked files are ignored), except for exactly the changes
#   our patches make: running the script again on a patched checkout is a no-op (idempotent).
# - Patches are applied with `git apply` after a `git apply --check` of all of them (all or nothing).
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

[[ -d $target ]] || die "$target is not a directory"
git -C "$target" rev-parse --is-inside-work-tree >/dev/null 2>&1 \
    || die "$target is not a git checkout; clone Megatron-LM and check out a supported release's commit first"
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
  Or run our launcher, which needs no checkout: torchrun ... -m megatron_wlb.megatron.launcher <flags>"
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
