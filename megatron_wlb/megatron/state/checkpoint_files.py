"""The files of a checkpoint directory we read and write: our sidecar (``wlb_packer_state.json``: its format, its
checksum, writing it atomically and reading it back) and what Megatron saved about the run (its ``args``, read without
loading a tensor). ``checkpoint`` decides what a resume does with them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from typing import Any

from megatron_wlb.megatron.data.packed import dumps_state

SIDECAR_NAME = "wlb_packer_state.json"
#: 2: the sidecar carries ``sha256``, the checksum of its other contents (``sidecar_checksum``);
#: 3: and ``data_stream_reset``, the last ``--wlb-reset-data-stream`` applied (``reset_record``);
#: 4: and ``fingerprint``, the digests of the datasets trained on (``agreement.RunFingerprint.datasets``)
SIDECAR_VERSION = 4
#: the keys the checksum covers, per version this build reads
VERSION_KEYS = {2: ("version", "iteration", "settings", "data", "data_stream_resets"),
                3: ("version", "iteration", "settings", "data", "data_stream_resets", "data_stream_reset"),
                4: ("version", "iteration", "settings", "data", "data_stream_resets", "data_stream_reset",
                    "fingerprint")}
SIDECAR_KEYS = VERSION_KEYS[SIDECAR_VERSION]
#: Megatron's ``iter_0000100`` directory names
ITERATION_DIR = re.compile(r"iter_(\d{7,})")


def iteration_dir(checkpoints_path: str, iteration: int, release: bool = False) -> str:
    """``<path>/iter_{iteration:07d}`` (or ``<path>/release``), as Megatron names it."""
    return os.path.join(checkpoints_path, "release" if release else f"iter_{int(iteration):07d}")


def save_data_state(directory: str, iteration: int, data_state: dict[str, Any],
                    settings: dict[str, Any] | None = None, data_stream_resets: int = 0,
                    data_stream_reset: dict[str, Any] | None = None, fingerprint: dict[str, str] | None = None) -> str:
    """Write the sidecar atomically (temp file + rename) into ``directory``; returns its path.
    ``data_stream_resets``: how often this training's data stream was restarted (``--wlb-reset-data-stream``);
    ``data_stream_reset``: the last restart (``reset_record``), None if there was none; ``fingerprint``: the
    datasets' digests (compared on resume)."""
    os.makedirs(directory, exist_ok=True)
    payload: dict[str, Any] = {"version": SIDECAR_VERSION, "iteration": int(iteration), "settings": settings,
                               "data": data_state, "data_stream_resets": int(data_stream_resets),
                               "data_stream_reset": data_stream_reset, "fingerprint": fingerprint}
    payload["sha256"] = sidecar_checksum(payload)
    path = os.path.join(directory, SIDECAR_NAME)
    fd, tmp = tempfile.mkstemp(prefix=".wlb_state.", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(dumps_state(payload))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def sidecar_keys(payload: Any) -> tuple[str, ...]:
    """The keys of ``payload``'s sidecar version (this build's for an unknown one)."""
    version = payload.get("version") if isinstance(payload, dict) else None
    return VERSION_KEYS.get(version, SIDECAR_KEYS) if isinstance(version, int) else SIDECAR_KEYS


def sidecar_checksum(payload: dict[str, Any]) -> str:
    """sha256 of the sidecar's contents (the keys of its version, canonical JSON)."""
    keys = sidecar_keys(payload)
    return hashlib.sha256(dumps_state({k: payload.get(k) for k in keys}).encode()).hexdigest()


def load_data_state(directory: str, iteration: int | None = None) -> dict[str, Any] | None:
    """Read the sidecar of ``directory`` (None if there is none); checks that it is intact (its
    checksum), its version and iteration. Every error is one line naming the file."""
    path = os.path.join(directory, SIDECAR_NAME)
    if not os.path.isfile(path):
        return None
    fix = "re-copy the checkpoint, or resume from another one"
    try:
        with open(path, encoding="utf-8") as f:
            payload = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc}); the WLB data state is corrupt: {fix}") from None
    keys = sidecar_keys(payload)
    if not isinstance(payload, dict) or any(k not in payload for k in keys):
        raise ValueError(f"{path}: not a WLB data state (expected a JSON object with {', '.join(keys)}); "
                         f"{fix}")
    if payload.get("version") not in VERSION_KEYS:
        raise ValueError(f"{path}: sidecar version {payload.get('version')!r}; this build reads "
                         f"{', '.join(map(str, VERSION_KEYS))}")
    if payload.get("sha256") != sidecar_checksum(payload):
        raise ValueError(f"{path}: its contents do not match its checksum (the file was altered or damaged); "
                         f"resuming from it could skip or repeat documents: {fix}")
    if iteration is not None and int(payload["iteration"]) != int(iteration):
        raise ValueError(f"{path} was written at iteration {payload['iteration']}, but the checkpoint "
                         f"resumes at iteration {iteration}")
    payload.setdefault("data_stream_reset", None)  # version 2 did not record it
    payload.setdefault("fingerprint", None)  # nor versions 2 and 3 this
    return payload


def newest_sidecar_before(checkpoints_path: str, iteration: int) -> int | None:
    """The newest iteration below ``iteration`` whose checkpoint directory in ``checkpoints_path`` holds a
    sidecar (None if none does): the checkpoint to resume from (``--ckpt-step``) when the latest lacks one."""
    try:
        names = os.listdir(checkpoints_path)
    except OSError:
        return None
    found = [int(m.group(1)) for m in map(ITERATION_DIR.fullmatch, names) if m and int(m.group(1)) < iteration]
    return max((i for i in found if os.path.isfile(os.path.join(iteration_dir(checkpoints_path, i), SIDECAR_NAME))),
               default=None)


def waiting_pieces(payload: dict | None) -> list[list[int]]:
    """The pieces ``[doc, offset, length, arrival]`` a saved packer held back (its ``extra["waiting"]``; [] for a
    packer that holds none, or no sidecar)."""
    data = (payload or {}).get("data") or {}
    packer = data.get("packer") if isinstance(data.get("packer"), dict) else data
    return [list(p) for p in ((packer or {}).get("extra") or {}).get("waiting", [])]


#: Megatron's legacy (``--ckpt-format torch``) checkpoint file of tensor rank 0, pipeline and expert rank 0 where
#: PP or EP > 1 (``find_checkpoint_rank_0``'s names)
LEGACY_RANK0_FILES = tuple(f"{name}/model_optim_rng.pt" for name in ("mp_rank_00", "mp_rank_00_000",
                                                                     "mp_rank_00_000_000"))
#: the file of a ``torch_dist`` checkpoint that holds its common state (Megatron's ``args`` among it)
COMMON_STATE_FILE = "common.pt"


def saved_megatron_args(checkpoint_dir: str) -> Any | None:
    """The ``args`` Megatron saved in the checkpoint directory ``checkpoint_dir`` (``iter_0000004``): from a
    ``torch_dist`` checkpoint's ``common.pt``, or a legacy checkpoint's rank-0 file (memory-mapped: no tensor is
    read); None where there is neither or it cannot be read (a format this build does not know)."""
    import torch  # only here: no other path of this module needs torch

    for name in (COMMON_STATE_FILE, *LEGACY_RANK0_FILES):
        path = os.path.join(checkpoint_dir, name)
        if not os.path.isfile(path):
            continue
        try:
            state = torch.load(path, map_location="cpu", weights_only=False, mmap=name != COMMON_STATE_FILE)
        except Exception:  # noqa: BLE001 - an unreadable file says nothing about who saved it
            return None
        return state.get("args") if isinstance(state, dict) else None
    return None


def saved_by_megatron_wlb(saved_args: Any) -> bool:
    """Whether Megatron's saved ``args`` show our flags (``wlb_*`` attributes: parsed with megatron_wlb applied,
    whose data iterator writes a sidecar with every checkpoint)."""
    return saved_args is not None and any(name.startswith("wlb_") for name in vars(saved_args))
