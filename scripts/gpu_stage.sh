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
# where it exists, else python3: the GPU machine runs 3.12), PLATFORM (manylinux2014_x86_64),
# MAX_MB (40: refuse a larger kit).
set -euo pipefail

die() { echo "gpu_stage.sh: error: $*" >&2; exit 1; }
[[ $# -eq 1 ]] || die "usage: MEGATRON_LM=/path/to/Megatron-LM $0 DIR"
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
: "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM git checkout or mirror holding the pinned commit}"
pinned=$(tr -d '[:space:]' < "$repo/patches/core_v0.16.1/PINNED_COMMIT")
git -C "$MEGATRON_LM" cat-file -e "$pinned^{commit}" 2>/dev/null \
    || die "$MEGATRON_LM does not hold the pinned commit $pinned (Megatron-LM core_v0.16.1): git -C $MEGATRON_LM fetch"
if [[ -z ${TARGET_PYTHON:-} ]]; then
    TARGET_PYTHON=python3
    command -v python3.12 >/dev/null 2>&1 && TARGET_PYTHON=python3.12
fi
command -v "$TARGET_PYTHON" >/dev/null 2>&1 || die "TARGET_PYTHON=$TARGET_PYTHON is not on PATH"
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
echo "gpu_stage.sh: staged $DIR ($(( size / 1048576 )) MB, Python $py_tag, Megatron-LM ${pinned:0:12}); on the GPU machine: $DIR/run.sh --part 1"
