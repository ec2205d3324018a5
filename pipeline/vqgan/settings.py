"""What `ttt vqgan train` is configured with. Light on imports: the CLI takes its defaults from here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class VQGANTrainSettings:
    out: Path = Path("./vqgan")  # written in the released layout
    config: Path | None = None  # a taming VQModel YAML; None: the sample VQGAN's architecture
    images: Path | None = None  # a folder of the user's images; None: the sample domain
    steps: int = 1500
    batch_size: int = 16
    learning_rate: float = 2e-3
    seed: int = 0
    heldout: int = 400  # held-out images to evaluate on
    restart_every: int = 20  # steps; codes unused for that long are restarted (never in the last 20%)
    device: str = "auto"
    threads: int | None = None  # torch CPU threads; None: torch's default (all cores)
    overwrite: bool = False
