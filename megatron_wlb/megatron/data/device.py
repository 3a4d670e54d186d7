"""This rank's training device (imports torch; nothing else)."""

from __future__ import annotations

import torch


def training_device() -> torch.device:
    """This rank's device: its current GPU, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


__all__ = ["training_device"]
