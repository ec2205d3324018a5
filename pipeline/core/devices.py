"""Which torch device a command runs on."""

from __future__ import annotations

import torch


def pick_device(requested: str = "auto") -> str:
    """`auto` takes the GPU when there is one; anything else (cpu, cuda, cuda:1, ...) is taken as given."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested
