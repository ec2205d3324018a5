"""The monitor's memory: an embedded SQLite database of the run's curves, its contributors and its checkpoints.

Every refresh is one transaction, so a monitor killed at any moment keeps everything up to its last refresh,
and a restarted one continues the curves and the leaderboard.

    series       one row per refresh: step, loss, samples/s, active peers, total samples, rejected records
    peers        one row per peer process (the key that signs its records): name, samples, first/last seen,
                 outliers (its contributions the other peers dropped or clipped)
    checkpoints  one row per checkpoint the monitor wrote (and where it pushed it)
    previews     the images drawn from each checkpoint
    verdicts     one row per auditor's verdict on a committed microbatch (training/monitor/verified.py)
    commitments  one row per peer's commitment of a global step: the rows it names (verified.py)
    revocations  one row per user whose token this monitor revoked, and the auditors who convicted it
                 (revocation.py)
"""

from __future__ import annotations

import math
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from training.metrics import PeerRecord
from training.monitor.aggregate import SwarmSummary, outliers_sent
from training.monitor.verified import AuditReading, Standing, VerdictRow, Votes, convicted_keys, standings, votes_of

SCHEMA = """
CREATE TABLE IF NOT EXISTS series (
    time REAL PRIMARY KEY, step INTEGER, loss REAL, samples_per_second REAL, active_peers INTEGER,
    total_samples INTEGER, rejected INTEGER
);
CREATE TABLE IF NOT EXISTS peers (
    key TEXT PRIMARY KEY, name TEXT, total_samples INTEGER, first_seen REAL, last_seen REAL,
    samples_per_second REAL, step INTEGER, parameters_hash TEXT, finished INTEGER, outliers INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS checkpoints (step INTEGER PRIMARY KEY, time REAL, loss REAL, path TEXT, pushed_to TEXT);
CREATE TABLE IF NOT EXISTS previews (step INTEGER, prompt TEXT, file TEXT, PRIMARY KEY (step, prompt));
CREATE TABLE IF NOT EXISTS verdicts (
    auditor TEXT, accused TEXT, step INTEGER, lineage TEXT, microbatch INTEGER, passed INTEGER,
    PRIMARY KEY (auditor, accused, step, lineage, microbatch)
);
CREATE TABLE IF NOT EXISTS commitments (
    key TEXT, step INTEGER, lineage TEXT, rows INTEGER, PRIMARY KEY (key, step, lineage)
);
CREATE TABLE IF NOT EXISTS revocations (username TEXT PRIMARY KEY, time REAL, auditors TEXT);
CREATE INDEX IF NOT EXISTS commitments_at ON commitments (step, lineage);
CREATE INDEX IF NOT EXISTS verdicts_at ON verdicts (step, lineage);
"""
# A committed step could be audited when someone else held its parameters (the audits recompute only at the auditor's
# own lineage): another key committed at the same step and lineage, or another auditor judged some microbatch there.
AUDITABLE = """(EXISTS (SELECT 1 FROM commitments other
                        WHERE other.step = c.step AND other.lineage = c.lineage AND other.key != c.key)
             OR EXISTS (SELECT 1 FROM verdicts v
                        WHERE v.step = c.step AND v.lineage = c.lineage AND v.auditor != c.key))"""
CHART_POINTS = 1000  # the most points a curve sends to the dashboard; older refreshes are thinned out
SPEED_WINDOW = 600.0  # seconds of history the time left is estimated from


@dataclass(frozen=True)
class Contributor:
    """A leaderboard row: everything a display name contributed, over all its peers and restarts."""

    name: str
    samples: int
    seconds_online: float
    last_seen: float
    online: bool
    samples_per_second: float
    step: int
    parameters_hash: str
    outliers: int  # contributions of its peers that the other peers dropped or clipped
    verified: tuple[int, int, int] = (0, 0, 0)  # verified samples: estimate, 95% interval (verified.py)
    audits: tuple[int, int] = (0, 0)  # its peers' audited microbatches: passed, failed
    convicted: bool = False  # one of its peers is (verified.py)
    probation: bool = False  # one of its active peers committed work that no audit has passed yet


def verified_total(leaderboard: list[Contributor]) -> tuple[int, int, int]:
    """The swarm's verified samples: the sum of every display name's (estimate, low, high)."""
    return tuple(sum(row.verified[i] for row in leaderboard) for i in range(3))


class History:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.db = sqlite3.connect(path, check_same_thread=False)  # the refresh loop is its only user
        self.db.executescript(SCHEMA)
        self.migrate()
        self.votes_read: list[Votes] | None = None  # the votes as of the verdicts recorded last (`votes`)
        self.standings_read: dict[str, Standing] | None = None  # and the standings they make (`audit_standings`)
        self.unaudited: set[str] = set()  # the keys nobody could audit at the last read of the commitments

    def migrate(self) -> None:
        """Bring a database of an older monitor up to SCHEMA (CREATE TABLE IF NOT EXISTS leaves its tables as
        they were): its peers' outliers start at 0."""
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(peers)")}
        if "outliers" not in columns:
            with self.db:
                self.db.execute("ALTER TABLE peers ADD COLUMN outliers INTEGER NOT NULL DEFAULT 0")

    def close(self) -> None:
        self.db.close()

    def record_refresh(
        self,
        now: float,
        records: list[PeerRecord],
        summary: SwarmSummary,
        rejected: int,
        audits: AuditReading | None = None,
    ) -> None:
        """One refresh, in one transaction: every peer's latest record, the audits' verdicts and the commitments
        read since the last one (a step's commitment as first read), then the swarm's point on the curves.

        A peer's outliers keep the largest count seen: the reports behind it are counts since each reporter
        started, and a reporter that restarts or leaves takes its part of the count with it.
        """
        sent = outliers_sent(records)
        audits = audits or AuditReading([], [])
        with self.db:
            self.db.executemany(
                """INSERT INTO peers (key, name, total_samples, first_seen, last_seen, samples_per_second, step,
                    parameters_hash, finished, outliers) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                    ON CONFLICT (key) DO UPDATE SET
                    name = excluded.name, total_samples = max(total_samples, excluded.total_samples),
                    first_seen = min(first_seen, excluded.first_seen), last_seen = max(last_seen, excluded.last_seen),
                    samples_per_second = excluded.samples_per_second, step = excluded.step,
                    parameters_hash = excluded.parameters_hash, finished = excluded.finished,
                    outliers = max(outliers, excluded.outliers)""",
                [
                    (
                        r.key,
                        r.metrics.display_name,
                        r.metrics.total_samples,
                        r.published_at,
                        r.published_at,
                        r.metrics.samples_per_second,
                        r.metrics.step,
                        r.metrics.parameters_hash,
                        r.metrics.finished,
                        sent[r.key],
                    )
                    for r in records
                ],
            )
            self.db.executemany(
                "INSERT OR REPLACE INTO verdicts VALUES (?, ?, ?, ?, ?, ?)",
                [(v.auditor, v.accused, v.step, v.lineage, v.microbatch, v.passed) for v in audits.verdicts],
            )
            self.db.executemany(
                "INSERT OR IGNORE INTO commitments VALUES (?, ?, ?, ?)",
                [(c.key, c.step, c.lineage, c.rows) for c in audits.committed],
            )
            if audits.verdicts:
                self.votes_read = self.standings_read = None
            if audits.unaudited is not None:
                self.unaudited = set(audits.unaudited)
            self.db.execute(
                "INSERT OR REPLACE INTO series VALUES (?, ?, ?, ?, ?, ?, ?)",
                (now, summary.global_step, summary.loss, summary.samples_per_second, summary.active_peers,
                 self.total_samples(), rejected),
            )  # fmt: skip

    def record_checkpoint(self, step: int, now: float, loss: float | None, path: str, pushed_to: str | None) -> None:
        with self.db:
            self.db.execute(
                "INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?, ?)", (step, now, loss, path, pushed_to)
            )

    def record_previews(self, step: int, files: dict[str, str]) -> None:
        with self.db:
            self.db.executemany(
                "INSERT OR REPLACE INTO previews VALUES (?, ?, ?)", [(step, p, f) for p, f in files.items()]
            )

    def leaderboard(self, now: float, active_window: float) -> list[Contributor]:
        """Display names by verified samples, then by samples contributed; online: one of its peers is active now."""
        rows = self.db.execute(
            """SELECT name, sum(total_samples), sum(last_seen - first_seen), max(last_seen),
                   max(finished = 0 AND last_seen >= :since),
                   coalesce(sum(CASE WHEN finished = 0 AND last_seen >= :since THEN samples_per_second END), 0),
                   max(step), parameters_hash,  -- SQLite takes the bare column from the row with max(last_seen)
                   sum(outliers)
               FROM peers GROUP BY name ORDER BY sum(total_samples) DESC, name""",
            {"since": now - active_window},
        ).fetchall()
        credit = self.credit(now - active_window)
        board = [
            Contributor(row[0], row[1], row[2], row[3], bool(row[4]), row[5], row[6], row[7], row[8], **credit[row[0]])
            for row in rows
        ]
        return sorted(board, key=lambda row: row.verified[0], reverse=True)  # stable: then by samples claimed

    def credit(self, since: float) -> dict[str, dict]:
        """Display name -> its verified samples (each key's claim, at most the rows it committed at steps that could
        be audited: AUDITABLE), audits, conviction, and probation (a key seen since `since` that committed rows no
        audit has passed, which the reducers of an audited run hold to one median peer, or that nobody can audit
        now, which they count for nothing: docs/design/averaging.md), summed over its peers' keys."""
        found = self.audit_standings()
        credit: dict[str, dict] = {}
        peers = self.db.execute(
            f"""SELECT peers.key, name, total_samples, coalesce(sum(rows), 0),
                   coalesce(sum(CASE WHEN {AUDITABLE} THEN rows END), 0), finished = 0 AND last_seen >= ?
               FROM peers LEFT JOIN commitments c ON c.key = peers.key GROUP BY peers.key""",
            (since,),
        )
        for key, name, claimed, committed, auditable, active in peers:
            standing = found.get(key, Standing())
            mine = credit.setdefault(
                name, {"verified": (0, 0, 0), "audits": (0, 0), "convicted": False, "probation": False}
            )
            verified = standing.credit(claimed, auditable)
            mine["verified"] = tuple(a + b for a, b in zip(mine["verified"], verified, strict=True))
            mine["audits"] = (mine["audits"][0] + standing.passed, mine["audits"][1] + standing.failed)
            mine["convicted"] = mine["convicted"] or standing.convicted
            unproven = committed > 0 and (standing.passed == 0 or key in self.unaudited)
            mine["probation"] = mine["probation"] or bool(active and unproven and not standing.convicted)
        return credit

    def convicted(self) -> set[str]:
        """The signing keys the audits convicted, by the auditors' word (verified.py)."""
        return convicted_keys(self.audit_standings())

    def audit_standings(self) -> dict[str, Standing]:
        """Each accused key's standing by the votes (verified.py), worked out once per refresh that brought verdicts:
        a refresh asks for it several times (the samples in all, twice; the swarm's figures; the leaderboard)."""
        if self.standings_read is None:
            self.standings_read = standings(self.votes())
        return self.standings_read

    def votes(self) -> list[Votes]:
        """The verdicts of other auditors than the accused on each audited microbatch, read from the database once
        after each refresh that brought verdicts (the standings and the revocations ask for them)."""
        if self.votes_read is None:
            rows = self.db.execute("SELECT auditor, accused, step, lineage, microbatch, passed FROM verdicts")
            self.votes_read = votes_of(VerdictRow(*row[:5], passed=bool(row[5])) for row in rows)
        return self.votes_read

    def names(self) -> dict[str, str]:
        """Each signing key seen in a metrics record -> its display name (in an authenticated run, its username)."""
        return dict(self.db.execute("SELECT key, name FROM peers"))

    def record_revocations(self, now: float, convicted: dict[str, frozenset[str]]) -> None:
        """Remember the users this monitor revoked, with their accusers."""
        with self.db:
            self.db.executemany(
                "INSERT OR IGNORE INTO revocations VALUES (?, ?, ?)",
                [(user, now, " ".join(sorted(auditors))) for user, auditors in convicted.items()],
            )

    def revoked_users(self) -> set[str]:
        """The users this monitor revoked, in this run or before its restart."""
        return {row[0] for row in self.db.execute("SELECT username FROM revocations")}

    def total_samples(self) -> int:
        """The samples the run's peers claim to have processed, but a convicted key's: its claims are not believed."""
        convicted = self.convicted()
        return sum(samples for key, samples in self.db.execute("SELECT key, total_samples FROM peers")
                   if key not in convicted)  # fmt: skip

    def curves(self) -> dict[str, list]:
        """The series for the charts, oldest first, thinned to at most CHART_POINTS points (the latest always in)."""
        count = self.db.execute("SELECT count(*) FROM series").fetchone()[0]
        stride = max(1, math.ceil(count / CHART_POINTS))
        rows = self.db.execute(
            "SELECT time, step, loss, samples_per_second, active_peers FROM series "
            "WHERE rowid % ? = 0 OR rowid = (SELECT max(rowid) FROM series) ORDER BY time",
            (stride,),
        ).fetchall()
        names = ("time", "step", "loss", "samples_per_second", "active_peers")
        return {name: [row[i] for row in rows] for i, name in enumerate(names)}

    def steps_per_second(self, now: float) -> float | None:
        """The swarm's speed over the last SPEED_WINDOW seconds, in global steps per second."""
        first = self.db.execute(
            "SELECT time, step FROM series WHERE time >= ? ORDER BY time LIMIT 1", (now - SPEED_WINDOW,)
        ).fetchone()
        last = self.db.execute("SELECT time, step FROM series ORDER BY time DESC LIMIT 1").fetchone()
        if first is None or last is None or last[0] <= first[0] or last[1] <= first[1]:
            return None
        return (last[1] - first[1]) / (last[0] - first[0])

    def latest_checkpoint(self) -> dict | None:
        row = self.db.execute("SELECT step, path, pushed_to FROM checkpoints ORDER BY step DESC LIMIT 1").fetchone()
        return None if row is None else {"step": row[0], "path": row[1], "pushed_to": row[2]}

    def latest_previews(self) -> dict | None:
        row = self.db.execute("SELECT max(step) FROM previews").fetchone()
        if row[0] is None:
            return None
        files = self.db.execute("SELECT prompt, file FROM previews WHERE step = ? ORDER BY rowid", (row[0],)).fetchall()
        return {"step": row[0], "images": [{"prompt": prompt, "url": f"/previews/{file}"} for prompt, file in files]}
