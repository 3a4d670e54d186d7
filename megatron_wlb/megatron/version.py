"""The Megatron-LM release this adapter is written and tested against, and the version check.

``PINNED_MEGATRON_COMMIT`` is the Megatron-LM commit of the megatron-core 0.16.1 release (tag
``core_v0.16.1``): CI tests the installed megatron-core 0.16.1 wheel, and ``patches/`` patches the
training code (``pretrain_gpt.py``, ``megatron/training``) of that same commit.
"""

from __future__ import annotations

PINNED_MEGATRON_COMMIT = "55ac7082517c3878ae653c07c09c534b8aed49f6"
PINNED_MEGATRON_TAG = "core_v0.16.1"
SUPPORTED_CORE = (">=0.16", "<0.20")


def _release(version: str) -> tuple[int, ...]:
    """Leading numeric release of a version string: ``"0.16.1rc0"`` -> (0, 16, 1)."""
    parts: list[int] = []
    for chunk in version.split("+")[0].split("."):
        digits = ""
        for ch in chunk:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if digits != chunk:
            break
    if not parts:
        raise ValueError(f"cannot read a release number from megatron-core version {version!r}")
    return tuple(parts)


def _bound(spec: str) -> tuple[str, tuple[int, ...]]:
    op = spec[:2] if spec[:2] in (">=", "<=", "==") else spec[:1]
    return op, _release(spec[len(op):])


def is_supported(version: str, supported: tuple[str, ...] = SUPPORTED_CORE) -> bool:
    """Whether ``version`` satisfies every bound in ``supported`` (release numbers compared padded)."""
    have = _release(version)
    for spec in supported:
        op, want = _bound(spec)
        width = max(len(have), len(want))
        a, b = have + (0,) * (width - len(have)), want + (0,) * (width - len(want))
        ok = {">=": a >= b, "<=": a <= b, "==": a == b, ">": a > b, "<": a < b}[op]
        if not ok:
            return False
    return True


def installed_core_version() -> str:
    """The installed megatron-core version, or a RuntimeError saying how to install it."""
    try:
        from importlib.metadata import PackageNotFoundError, version
        try:
            return version("megatron-core")
        except PackageNotFoundError:
            pass
        import megatron.core
        return str(megatron.core.__version__)
    except ImportError as exc:
        raise RuntimeError("megatron_wlb.megatron needs Megatron-LM's megatron-core "
                           f"({', '.join(SUPPORTED_CORE)}): pip install 'megatron-core==0.16.1' "
                           f"or run from a Megatron-LM checkout at {PINNED_MEGATRON_TAG}") from exc


def check_core_version(version: str | None = None) -> str:
    """Return the megatron-core version, or raise naming the supported range if it is outside it."""
    version = installed_core_version() if version is None else version
    if not is_supported(version):
        raise RuntimeError(f"megatron-core {version} is not supported by megatron_wlb.megatron; supported: "
                           f"{' '.join(SUPPORTED_CORE)} (tested: 0.16.1, Megatron-LM {PINNED_MEGATRON_TAG} "
                           f"{PINNED_MEGATRON_COMMIT[:12]}). Install a supported megatron-core or pin your "
                           "checkout to that tag.")
    return version
