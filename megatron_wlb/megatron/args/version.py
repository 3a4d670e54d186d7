"""The Megatron-LM releases this adapter supports (those CI trains with), and the version check.

Four ways in, each tested by running Megatron's own training loop (tests/test_megatron_train.py):

- megatron-core **0.19.x** (0.19.2 on the package index ships ``megatron/training``): our launcher
  ``python -m megatron_wlb.megatron.entry.launcher`` over ``megatron.training.pretrain``;
- a Megatron-LM **core_v0.19.0** checkout, patched with ``patches/core_v0.19.0``: its own ``pretrain_gpt.py``
  (its model builders, MTP/ModelOpt hooks and loss) with our data and CP hooks;
- a Megatron-LM **core_v0.16.1** checkout (``PINNED_MEGATRON_COMMIT``), patched with ``patches/core_v0.16.1``:
  its own ``pretrain_gpt.py`` (the megatron-core 0.16.1 wheel has no ``megatron/training``).

- Megatron-LM **main** (core 0.20.0 at ``MAIN_COMMIT``), a checkout on ``PYTHONPATH``: our launcher, or main's own
  sequence-packing path with ``sequence_packing_scheduler = "wlb"`` (``main_schedule.py``);
- Megatron-LM **main after PR #6742** (``MAIN_6742_COMMIT``, core 0.20.0) and **dev** (``DEV_COMMIT``, core 0.19.0
  by its package_info), a checkout on ``PYTHONPATH``: our launcher (``MOVING_CHECKOUTS``).

Releases 0.17 and 0.18 are not admitted: nothing trains with them in CI (0.18 changed the CP and
batch functions the patch hooks, and the launcher is tested on 0.19 and main only).
"""

from __future__ import annotations

import importlib
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from packaging.version import InvalidVersion, Version

PINNED_MEGATRON_COMMIT = "55ac7082517c3878ae653c07c09c534b8aed49f6"
PINNED_MEGATRON_TAG = "core_v0.16.1"
#: the Megatron-LM checkouts ``scripts/apply_patches.sh`` patches: tag -> commit (``patches/<tag>/PINNED_COMMIT``)
PATCHED_CHECKOUTS = {PINNED_MEGATRON_TAG: PINNED_MEGATRON_COMMIT,
                     "core_v0.19.0": "5be9626709af2722333bf54797c954c09edeada3"}
#: Megatron-LM main as CI trains it (core 0.20.0, 2026-08-22): our launcher over the checkout
MAIN_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
#: Megatron-LM main after PR #6742 (``refs/pull/6742/merge``, 2026-08-22): ``--sequence-packing-scheduler`` is a flag
#: (choices ``dp_balanced``), ``ModelParallelConfig`` checks the name, TransformerConfig requires TE >= 2.9
MAIN_6742_COMMIT = "e8fef4ebb23ef4559b3ef43204a74cc2aa1cb414"
#: Megatron-LM dev (``refs/heads/dev``, 2026-08-21): string-keyed ``scheduler_map``, ``max_num_seqs=``,
#: ``--dynamic-context-parallel``; TransformerConfig requires ``cp_comm_type`` all_gather with local attention
DEV_COMMIT = "d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1"
#: the moving Megatron-LM checkouts CI trains our launcher over (name -> commit; tests/test_megatron_train.py), and
#: whose own data_schedule takes our scheduler (tests/test_main_scheduler.py)
MOVING_CHECKOUTS = {"main": MAIN_COMMIT, "main-6742": MAIN_6742_COMMIT, "dev": DEV_COMMIT}
#: series admitted only as a checkout (no wheel of it is trained, so pip's [megatron] extra does not install it)
CHECKOUT_ONLY_SERIES = frozenset({(0, 20)})
#: (major, minor) release series admitted, and how each is run
SUPPORTED_SERIES = {(0, 16): f"a Megatron-LM checkout at {PINNED_MEGATRON_TAG}, patched (scripts/apply_patches.sh)",
                    (0, 19): "the megatron-core 0.19 wheel with megatron_wlb.megatron.entry.launcher, or a Megatron-LM "
                             "checkout at core_v0.19.0, patched (scripts/apply_patches.sh)",
                    (0, 20): f"a Megatron-LM main checkout (trained at {MAIN_COMMIT[:12]}) on PYTHONPATH with "
                             "megatron_wlb.megatron.entry.launcher"}
#: the release of each series that CI trains with
TESTED_RELEASES = ("0.16.1", "0.19.2", "0.20.0")

# -- the one install advice (version.py's messages, README.md's quick start: tests/test_install_advice.py) -----
#: the megatron-core wheel users install: the newest on the package index that setup.py's [megatron] pin admits
CORE_WHEEL_RELEASE = "0.19.2"
#: the oldest Python the wheel's metadata admits; its cp311 wheel works on 3.11, installed without that check
CORE_WHEEL_PYTHON = (3, 12)
#: the Pythons the install advice covers (CI's CPU torch runs on 3.11; the wheel asks for 3.12)
INSTALL_PYTHONS = ((3, 12), (3, 11))


def core_install_command(python: tuple[int, int] | None = None) -> str:
    """The pip command that installs the megatron-core wheel on ``python`` (default: this interpreter's)."""
    python = (sys.version_info.major, sys.version_info.minor) if python is None else python
    older = "" if python >= CORE_WHEEL_PYTHON else "--no-deps --ignore-requires-python "
    return f"python -m pip install {older}megatron-core=={CORE_WHEEL_RELEASE}"


def install_command(python: tuple[int, int] | None = None) -> str:
    """The quick start's install of megatron-wlb with its [megatron] extra from a checkout, on ``python``: on
    3.12 the extra brings the wheel; on 3.11 pip's resolver stops at an older one, so the wheel follows."""
    python = (sys.version_info.major, sys.version_info.minor) if python is None else python
    extra = 'python -m pip install -e ".[megatron]"'
    return extra if python >= CORE_WHEEL_PYTHON else f"{extra} && {core_install_command(python)}"


def _parse(version: str) -> Version:
    try:
        return Version(version)
    except InvalidVersion as exc:
        raise ValueError(f"cannot read megatron-core version {version!r} (expected e.g. 0.19.2)") from exc


def is_supported(version: str) -> bool:
    """Whether ``version``'s release series is one that CI trains with (pre-releases of it included)."""
    return tuple(_parse(version).release[:2]) in SUPPORTED_SERIES


def installed_core_version() -> str:
    """The megatron-core version Python imports (a checkout on ``sys.path`` wins over an installed wheel,
    as it does for the import itself), or a RuntimeError saying how to install one."""
    try:
        from megatron.core import package_info  # lazy: the version check runs before Megatron is imported

        return str(package_info.__version__)
    except ImportError:
        pass
    try:
        return version("megatron-core")
    except PackageNotFoundError as exc:
        raise RuntimeError(f"megatron_wlb.megatron needs Megatron-LM's megatron-core: {core_install_command()} "
                           f"(see the README), or run from a Megatron-LM checkout at {PINNED_MEGATRON_TAG}") from exc


def check_core_version(version: str | None = None) -> str:
    """Return the megatron-core version, or raise naming the supported releases if it is outside them."""
    version = installed_core_version() if version is None else version
    if not is_supported(version):
        ways = "; ".join(f"{major}.{minor}.x: {how}" for (major, minor), how in SUPPORTED_SERIES.items())
        raise RuntimeError(f"megatron-core {version} is not supported by megatron_wlb.megatron; supported: {ways} "
                           f"(CI trains with {', '.join(TESTED_RELEASES)})")
    return version


# -- Megatron's training code (megatron/training: checkouts, and wheels from 0.19 on) ------------------------
#: Megatron training-code modules apply() hooks (all present at the pinned commit)
TRAINING_MODULES = ("arguments", "initialize", "training", "checkpointing", "utils", "global_vars")


def training_import_error(module: str, exc: ImportError) -> str:
    """The one-line reason ``megatron.training.<module>`` failed to import, naming the real cause: the training
    code itself missing (a megatron-core wheel before 0.19), or a module or name it imports."""
    missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    if missing in ("megatron", "megatron.training", f"megatron.training.{module}"):
        return (f"megatron_wlb.megatron.apply() hooks Megatron-LM's training code (megatron.training.{module}), "
                f"which is not importable here: {core_install_command()} (its wheel ships megatron/training; "
                "earlier wheels do not), or put a "
                f"Megatron-LM checkout at {PINNED_MEGATRON_TAG} ({PINNED_MEGATRON_COMMIT[:12]}) on PYTHONPATH "
                f"(import error: {exc})")
    if missing:
        return (f"megatron.training.{module} failed to import: it needs the module {missing!r}, which is not "
                f"installed: pip install {missing.split('.')[0]} (megatron_wlb's [megatron] extra lists what "
                f"Megatron's training code imports) (import error: {exc})")
    return f"megatron.training.{module} failed to import: {exc}"


def import_training_modules() -> dict[str, Any]:
    """Megatron's ``TRAINING_MODULES`` by name; a RuntimeError naming the cause where one does not import."""
    mods = {}
    for name in TRAINING_MODULES:
        try:
            mods[name] = importlib.import_module(f"megatron.training.{name}")
        except ImportError as exc:
            raise RuntimeError(training_import_error(name, exc)) from exc
    return mods
