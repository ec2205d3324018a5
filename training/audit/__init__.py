"""Work that is checked rather than claimed: each peer commits to what it computed, others recompute a piece of it.

    sketch.py    a few dozen numbers that stand for one microbatch's gradient (linear, cheap, one seed per run)
    records.py   the signed records in the run's DHT: commitments, verdicts, and who stands convicted
    ledger.py    an auditor's verdicts: kept, published under its key, and the convictions they make
    received.py  a reducer's check: what each sender sent it, against the sketches the sender committed
    auditor.py   a peer's part: commit every step; on the steps its own coins choose, recompute one microbatch of
                 another peer and publish the verdict; check what the senders of its reduced rounds sent; refuse
                 the peers that two auditors convicted
    helper.py    a public helper's part (`ttt monitor --assist-averaging`): check what the senders of its reduced
                 rounds sent, and refuse whom it convicts

docs/training.md#checked-work says what this catches, what it costs and what it does not catch yet.
"""
