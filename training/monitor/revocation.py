"""`ttt monitor --revoke-convicted AUTHORITY`: in an authenticated run, the monitor revokes the token of each user
whose peer the audits (training/audit/) convicted, as the organiser's `ttt auth revoke` would. The auth server reads
the same folder, so it serves the new list at once; the monitor stores it in the run's DHT at once, and every peer
adopts it at its next read (--auth-refresh): from then on the peers refuse that user's requests, and its own peers
leave with one line.

The monitor recomputes nothing, so it takes the auditors' word (verified.py's `standings`: a microbatch fails when
more of its auditors failed it than passed it), but it counts the auditors by their verified usernames, not by their
keys: a user counts once however many peers it runs, a user's own peers neither accuse nor vouch for it, and a key
without a verified username counts for nothing. A user is revoked once CONVICTING_AUDITORS different users failed its
peers' work. The monitor revokes a user once: `ttt auth revoke --lift` stands, across the monitor's restarts too
(its history remembers whom it revoked).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from rich.console import Console

from training.auth.keys import AuthError, AuthorityPublicKey, load_authority, load_authority_public_key
from training.auth.tokens import RevocationList, read_revocations, sign_revocations, write_revocations
from training.config import MonitorSettings
from training.monitor.verified import Votes, standings


def convicted_users(votes: Iterable[Votes], usernames: Mapping[str, str]) -> dict[str, frozenset[str]]:
    """Username -> the other users whose audits convict its peers' work (all its peers' together), from the votes on
    each audited microbatch and each signing key's verified username (`usernames`)."""
    by_user = []
    for vote in votes:
        accused = usernames.get(vote.accused)
        if accused is None:
            continue
        passers, failers = (
            {usernames.get(key) for key in keys} - {None, accused} for keys in (vote.passers, vote.failers)
        )
        by_user.append(Votes(accused, frozenset(passers), frozenset(failers)))
    return {user: standing.accusers for user, standing in standings(by_user).items() if standing.convicted}


class ConvictedRevoker:
    """Signs a revocation list, with the run's authority, that adds the users the audits convicted."""

    def __init__(self, folder: Path, run_id: str, run_key: AuthorityPublicKey, console: Console) -> None:
        self.authority = load_authority(folder)
        if self.authority.run_id != run_id:
            raise AuthError(
                f"--revoke-convicted {folder} is the authority of run {self.authority.run_id!r}, not of "
                f"--run-id {run_id!r}"
            )
        if self.authority.public.key.to_bytes() != run_key.key.to_bytes():
            raise AuthError(f"--revoke-convicted {folder} is another authority than --authority-key's (run.pub)")
        self.console = console

    def revoke(self, convicted: Mapping[str, frozenset[str]]) -> RevocationList | None:
        """The authority's list with the users of `convicted` added, signed and written to its folder; None when
        every one of them is revoked already."""
        current = read_revocations(self.authority)
        added = {user: auditors for user, auditors in convicted.items() if user not in current.revoked}
        if not added:
            return None
        now = time.time()
        revocations = sign_revocations(self.authority, {**current.revoked, **dict.fromkeys(added, now)})
        write_revocations(self.authority, revocations)
        for user, auditors in sorted(added.items()):
            self.console.print(
                f"audit: {user} revoked: its work failed the audits of {', '.join(sorted(auditors))} "
                f"(`ttt auth revoke --lift {user}` admits it again)"
            )
        return revocations


def open_revoker(settings: MonitorSettings, console: Console) -> ConvictedRevoker | None:
    """The revoker of --revoke-convicted, checked against the run's authority key; None without the option."""
    if settings.revoke_convicted is None:
        return None
    if settings.auth is None:
        raise AuthError(
            "--revoke-convicted revokes the tokens of an authenticated run: pass --authority-key and how this "
            "monitor is admitted (--auth-server or --token), as the run's peers do"
        )
    run_key = load_authority_public_key(Path(settings.auth.authority_key))
    return ConvictedRevoker(Path(settings.revoke_convicted), settings.run.run_id, run_key, console)
