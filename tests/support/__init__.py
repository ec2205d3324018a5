"""What the tests (and the bench scripts) use to drive ttt as its users do.

    commands.py         `ttt` run as a user runs it; the settings every end-to-end and swarm test shares
    datasets.py         code datasets made on the spot: the embedded sample, random paper-scale rows
    swarm_runs.py       peers of one run started at different times, their progress lines read back; the monitor
    faulty_peer.py      a `ttt train` peer that misbehaves on purpose (python -m tests.support.faulty_peer)
    intruder.py         a stranger who tries to get into an authenticated run (python -m tests.support.intruder)
    synthetic_peers.py  many signed metrics records without the peers, for the monitor
    browser.py          Debian's chromium driven by Playwright: the dashboard and the join page
    hub_stand_in.py     a local stand-in for the Hugging Face Hub's HTTP API
    netns.py            a small Internet in network namespaces: public hosts, homes behind NAT routers, shaped links

Import them as `tests.support.NAME` with the repository's root on the import path: pytest puts it there (tests/
is a package), and the bench scripts run as `python -m bench.NAME` from the root. `module_command` starts one of
the runnable modules above in a process of its own.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: where `python -m tests.support.NAME` runs


def module_command(name: str) -> list[str]:
    """The argv that runs tests/support/NAME.py as a module (run it with cwd=ROOT)."""
    return [sys.executable, "-m", f"tests.support.{name}"]
