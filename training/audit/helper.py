"""A public helper's checks (`ttt monitor --assist-averaging`): what each sender sent it, against its commitments.

In a run of homes behind NAT the helpers are its only reducers (a home cannot be dialled, so it reduces nothing):
every piece of every gradient passes through a helper and through no trainer, and the trainers' own reducers'
checks (received.py) never see a sender's work. A helper trains on nothing and holds no data to recompute with, so
it audits nobody's microbatches; it does what every trainer's reducer does: after each round it reduced, it checks
each sender's sums against the sender's commitments, publishes a failed check as a verdict under its own signing
key, and convicts by the trainers' rule (records.py's `convicted_by`: two auditors, itself among them), telling its
averager at once. Its averager also reads the run's verdicts as a trainer's does (standing.py): it refuses whom it
convicted, and holds every sender on probation in its reducer, having recomputed nobody's work.
"""

from __future__ import annotations

from dataclasses import dataclass

from training.audit.ledger import Ledger, read_records
from training.audit.received import ReducerCheck

HELPER_OUTCOME = "its averaging requests are refused from now on"  # what a helper's conviction does


@dataclass
class HelperChecks:
    """A helper's reducer's checks, judged into its `Ledger` after each of its global steps."""

    ledger: Ledger
    reducer: ReducerCheck
    checked_step: int = -1  # the helper's last global step checked: it steps every half second, checks once a step

    def step_done(self, step: int) -> None:
        """At a new global `step` of the helper (a step already checked: nothing): check the rounds it reduced since
        the last (once their senders' commitments are read), publish its verdicts, and announce whom it now
        convicts."""
        if step == self.checked_step:
            return
        self.checked_step = step
        reduced = self.reducer.collect()
        found = read_records(self.ledger.dht, self.ledger.run_id, reduced)
        if found is None:  # a slow DHT: checked at the next step, up to AUDIT_LAG steps after the round
            return
        accusations, commitments = found
        judged = len(self.ledger.verdicts)
        if reduced:
            self.reducer.check(step, commitments, self.ledger)
        self.ledger.announce_convictions(accusations, commitments)
        self.ledger.publish(self.ledger.verdicts[judged:])
