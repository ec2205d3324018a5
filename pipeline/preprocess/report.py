"""The run's counts: what the summary table and the data card both report."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from rich.table import Table

from pipeline.preprocess.manifest import ShardRecord

STAGES = ("download", "encode", "write")


@dataclass
class RunSummary:
    rows_in: int
    filtered: Counter
    shards: list[ShardRecord]
    num_shards: int
    filter_seconds: float
    wall_seconds: float = 0.0
    shards_this_run: int = 0
    rows_this_run: int = 0

    @property
    def failed(self) -> Counter:
        """Download/resize failures by reason, over every shard written so far."""
        return sum((Counter(s.failures) for s in self.shards), Counter())

    @property
    def rows_after_filters(self) -> int:
        return self.rows_in - sum(self.filtered.values())

    @property
    def rows_written(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def bytes_written(self) -> int:
        return sum(s.bytes for s in self.shards)

    @property
    def jpeg_bytes(self) -> int:
        return sum(s.jpeg_bytes for s in self.shards)

    @property
    def bytes_per_sample(self) -> float:
        return self.bytes_written / max(self.rows_written, 1)

    def stage_rate(self, stage: str) -> float:
        """Samples per second of one worker in `stage` (rows handled / task seconds, over all shards)."""
        handled = sum(s.planned_rows if stage == "download" else s.rows for s in self.shards)
        seconds = sum(s.seconds[stage] for s in self.shards)
        return handled / seconds if seconds else 0.0

    def document(self) -> dict:
        """The summary as `ttt preprocess --json` prints it."""
        return {
            "rows_in": self.rows_in,
            "filtered": dict(sorted(self.filtered.items())),
            "rows_after_filters": self.rows_after_filters,
            "failed": dict(sorted(self.failed.items())),
            "rows_written": self.rows_written,
            "shards_written": len(self.shards),
            "shards": self.num_shards,
            "shards_this_run": self.shards_this_run,
            "bytes_written": self.bytes_written,
            "bytes_per_sample": self.bytes_per_sample,
            "samples_per_second": {stage: self.stage_rate(stage) for stage in STAGES},
            "wall_seconds": self.wall_seconds,
        }

    def table(self) -> Table:
        table = Table(title="ttt preprocess", show_header=True, header_style="bold")
        table.add_column("")
        table.add_column("count", justify="right")
        table.add_row("rows in", f"{self.rows_in:,}")
        for reason, count in sorted(self.filtered.items()):
            table.add_row(f"  filtered: {reason}", f"{count:,}")
        table.add_row("rows after filters", f"{self.rows_after_filters:,}")
        for reason, count in sorted(self.failed.items()):
            table.add_row(f"  failed: {reason}", f"{count:,}")
        table.add_row("encoded and written", f"{self.rows_written:,}")
        table.add_row("shards", f"{len(self.shards)} of {self.num_shards} ({self.shards_this_run} this run)")
        table.add_row("bytes / sample", f"{self.bytes_per_sample:,.0f}")
        if self.jpeg_bytes:
            table.add_row("JPEG bytes / code bytes", f"{self.jpeg_bytes / max(self.bytes_written, 1):.1f}x")
        table.add_row("filter (samples/s, driver)", f"{self.rows_in / max(self.filter_seconds, 1e-9):,.0f}")
        for stage in STAGES:
            table.add_row(f"{stage} (samples/s per worker)", f"{self.stage_rate(stage):,.1f}")
        if self.wall_seconds:
            rate = self.rows_this_run / self.wall_seconds
            table.add_row("end to end (samples/s, this run)", f"{rate:,.1f}")
        return table
