"""A public helper's checks (`ttt monitor --assist-averaging`): what each sender sent it, against its commitments,
and with --audit-rate the others' work recomputed.

In a run of homes behind NAT the helpers are its only reducers (a home cannot be dialled, so it reduces nothing):
every piece of every gradient passes through a helper and through no trainer, and the trainers' own reducers'
checks (received.py) never see a sender's work. A helper trains on nothing. After each round it reduced, it checks
each sender's sums against the sender's commitments as every trainer's reducer does, publishes a failed check as a
verdict under its own signing key, and convicts by the trainers' rule (records.py's `convicted_by`: two auditors,
itself among them), telling its averager at once. Its averager also reads the run's verdicts as a trainer's does
(standing.py): it refuses whom it convicted, and holds every sender it holds unproven on probation.

Without data, that is all it can check: a peer whose recomputed microbatches fail the homes' audits but who sends
what it committed (a quiet poisoner with an honest claim) is convicted by the homes and still averaged by the
helper, held to the median norm. With --audit-rate the helper reads the run's dataset and audits as a trainer does
(auditor.py's `Audits`, which commits nothing here): it holds the parameters of every global step (it applies each
round's average as the trainers do), recomputes a microbatch at that share of its steps, and re-checks every failed
verdict of another auditor, so it convicts what the homes' audits found and its passed audits prove the honest out
of probation. It starts only once a trainer's record names the dataset it read (`data_agreed`): recomputed from
other rows, every microbatch would fail.
"""

from __future__ import annotations

from dataclasses import dataclass

from training.audit.auditor import Audits
from training.audit.ledger import Ledger, read_records
from training.audit.received import ReducerCheck

HELPER_OUTCOME = "its averaging requests are refused from now on"  # what a helper's conviction does


@dataclass
class HelperChecks:
    """A helper's checks, judged into its `Ledger` after each of its global steps: its reducer's alone, or its
    `audits` (which make its reducer's checks too) once the trainers read its data."""

    ledger: Ledger
    reducer: ReducerCheck
    audits: Audits | None = None  # with --audit-rate: the others' work recomputed from the run's data
    data_agreed: bool = False  # a trainer's record names the dataset `audits` read (SwarmSnapshots.trainers_read)
    checked_step: int = -1  # the helper's last global step checked: it steps every half second, checks once a step

    def step_done(self, step: int) -> None:
        """At a new global `step` of the helper (a step already checked: nothing): its audits, or the checks of the
        rounds it reduced since the last (once their senders' commitments are read), its verdicts published and whom
        it now convicts announced."""
        if step == self.checked_step:
            return
        self.checked_step = step
        if self.audits is not None and self.data_agreed:
            self.audits.step_done(step)
            return
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
