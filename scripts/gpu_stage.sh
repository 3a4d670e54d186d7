#!/usr/bin/env bash
# Stage everything a bare GPU machine (Python, torch with its triton, no network, no git, no compiler) needs
# to run every GPU measurement of megatron-wlb: scripts/gpu_run.sh there (docs/gpu.md).
#
#   MEGATRON_LM=/path/to/Megatron-LM scripts/gpu_stage.sh DIR
#
# Run it on a machine with git, pip (with an index), a C++ compiler and the target Python. DIR receives:
#   megatron-wlb/   this project's tracked files (git ls-files)
#   megatron-lm/    Megatron-LM at patches/core_v0.16.1/PINNED_COMMIT (megatron/ and the GPT entry point), patched,
#                   with Megatron's C++ dataset helper prebuilt for the target Python
#   wheels/         the wheels of megatron_wlb/requirements.py (+ numpy) for the target Python and platform
#   run.sh          -> megatron-wlb/scripts/gpu_run.sh;  MANIFEST.json: what was staged, for which Python
# Environment: MEGATRON_LM (a Megatron-LM git checkout or mirror holding the pinned commit; required),
# TARGET_PYTHON (the interpreter whose version the wheels and the helper are built for; default python3.12
# where it runs, else python3: the GPU machine runs 3.12; a candidate that is on PATH but does not run, such
# as a pyenv shim of a version not installed, is skipped, saying so), PLATFORM (manylinux2014_x86_64),
# MAX_MB (40: refuse a larger kit). `scripts/gpu_stage.sh --which-python` prints the interpreter it would take.
set -euo pipefail

die() { echo "gpu_stage.sh: error: $*" >&2; exit 1; }
[[ $# -eq 1 ]] || die "usage: MEGATRON_LM=/path/to/Megatron-LM $0 DIR (or $0 --which-python)"
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# the target interpreter: one that runs (`"$py" -c ''`), not merely one that `command -v` finds
runs() { command -v "$1" >/dev/null 2>&1 && "$1" -c '' >/dev/null 2>&1; }
if [[ -n ${TARGET_PYTHON:-} ]]; then
    runs "$TARGET_PYTHON" || die "TARGET_PYTHON=$TARGET_PYTHON does not run (\`$TARGET_PYTHON -c ''\` failed or it is not on PATH)"
    why="TARGET_PYTHON"
else
    why=""
    for candidate in python3.12 python3; do
        if runs "$candidate"; then TARGET_PYTHON=$candidate; break; fi
        command -v "$candidate" >/dev/null 2>&1 \
            && why+="$candidate is on PATH ($(command -v "$candidate")) but does not run; "
    done
    [[ -n ${TARGET_PYTHON:-} ]] || die "${why}no python3.12 or python3 that runs: set TARGET_PYTHON"
    why+="default: python3.12 where it runs, else python3"
fi
echo "gpu_stage.sh: target Python: $TARGET_PYTHON ($(command -v "$TARGET_PYTHON"), $("$TARGET_PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])'); $why)"
[[ $1 != --which-python ]] || exit 0
: "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM git checkout or mirror holding the pinned commit}"
pinned=$(tr -d '[:space:]' < "$repo/patches/core_v0.16.1/PINNED_COMMIT")
git -C "$MEGATRON_LM" cat-file -e "$pinned^{commit}" 2>/dev/null \
    || die "$MEGATRON_LM does not hold the pinned commit $pinned (Megatron-LM core_v0.16.1): git -C $MEGATRON_LM fetch"
PLATFORM=${PLATFORM:-manylinux2014_x86_64}
mkdir -p "$1"
DIR=$(cd "$1" && pwd)
[[ -z $(ls -A "$DIR") ]] || die "$DIR is not empty"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# 1. this project (tracked files of the work tree as they are now)
mkdir -p "$DIR/megatron-wlb"
(cd "$repo" && git ls-files -z --cached --others --exclude-standard | grep -zv '^docs/img/' \
    | xargs -0 tar -cf - 2>/dev/null) | tar -xf - -C "$DIR/megatron-wlb"

# 2. Megatron-LM at the pinned commit (what the GPT entry point imports), patched by content (no .git)
mkdir -p "$DIR/megatron-lm"
git -C "$MEGATRON_LM" archive "$pinned" megatron pretrain_gpt.py gpt_builders.py model_provider.py LICENSE \
    | tar -xf - -C "$DIR/megatron-lm"
"$repo/scripts/apply_patches.sh" "$DIR/megatron-lm"

# 3. Megatron's C++ dataset helper, prebuilt for the target Python (the GPU machine has no compiler)
py_tag=$("$TARGET_PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
suffix=$("$TARGET_PYTHON" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
pyinc=$("$TARGET_PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
[[ -f $pyinc/Python.h ]] || die "no Python.h for $TARGET_PYTHON ($pyinc): install its development headers"
python -m pip download -q --no-deps --only-binary=:all: -d "$tmp/pybind11" pybind11 \
    || die "cannot download pybind11 (its headers build the dataset helper)"
(cd "$tmp/pybind11" && python -m zipfile -e pybind11-*.whl .)
datasets=$DIR/megatron-lm/megatron/core/datasets
"${CXX:-g++}" -O3 -Wall -shared -std=c++17 -fPIC -I"$tmp/pybind11/pybind11/include" -I"$pyinc" \
    "$datasets/helpers.cpp" -o "$datasets/helpers_cpp$suffix" || die "building the dataset helper failed"

# 4. the wheels (megatron_wlb/requirements.py, numpy for a machine without it) for the target Python
abi=cp${py_tag/./}
mapfile -t reqs < <(PYTHONPATH=$repo python -m megatron_wlb.requirements)
python -m pip download -q --only-binary=:all: --python-version "$py_tag" --implementation cp --abi "$abi" \
    --platform "$PLATFORM" -d "$DIR/wheels" "${reqs[@]}" numpy \
    || die "pip download of ${reqs[*]} numpy for Python $py_tag ($PLATFORM) failed"

# 5. the commands and the manifest
ln -s megatron-wlb/scripts/gpu_run.sh "$DIR/run.sh"
size=$(du -sbL "$DIR" | cut -f1)
python - "$DIR" "$pinned" "$py_tag" "$PLATFORM" "$size" "$suffix" <<'EOF'
import json, os, sys
d, pinned, py, platform, size, suffix = sys.argv[1:]
json.dump({"format": "megatron-wlb-gpu-kit/1", "megatron_lm_commit": pinned, "python": py, "platform": platform,
           "bytes": int(size), "dataset_helper": "megatron/core/datasets/helpers_cpp" + suffix,
           "wheels": sorted(os.listdir(os.path.join(d, "wheels")))}, open(os.path.join(d, "MANIFEST.json"), "w"),
          indent=1)
EOF
max_mb=${MAX_MB:-40}
(( size <= max_mb * 1024 * 1024 )) || die "the kit is $(( size / 1048576 )) MB, over MAX_MB=$max_mb"
echo "gpu_stage.sh: staged $DIR ($(( size / 1048576 )) MB, Python $py_tag, Megatron-LM ${pinned:0:12}); on the GPU machine: $DIR/run.sh --all --budget 540 (docs/gpu.md)"
