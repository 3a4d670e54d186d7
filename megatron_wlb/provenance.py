"""Provenance of a measurement: which machine produced it (benchmarks, traces and reports record it).

A floor module: it imports nothing of the package, so the CLI, the Megatron adapter and the benchmark
scripts all take it from here.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

__all__ = ["machine"]


def machine() -> str:
    """One line naming this machine's CPU, cores, Python and load (benchmarks record it)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ""
    if hasattr(os, "getloadavg"):
        load = f", load average {os.getloadavg()[0]:.1f} at start (shared machine)"
    return f"{cpu}, {os.cpu_count()} cores visible, Python {platform.python_version()}, {platform.system()}{load}"
