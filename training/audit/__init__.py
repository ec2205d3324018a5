"""Work that is checked rather than claimed: each peer commits to what it computed, others recompute a piece of it.

    sketch.py    a few dozen numbers that stand for one microbatch's gradient (linear, cheap, seeded per step)
    records.py   the signed records in the run's DHT: commitments, verdicts, and who stands convicted
    auditor.py   a peer's part: commit every step; on the steps its own coins choose, recompute one microbatch of
                 another peer and publish the verdict; refuse the peers that two auditors convicted

docs/robustness.md says what this catches, what it costs and what it does not catch yet.
"""
