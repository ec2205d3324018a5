"""`ttt train` peers behind real home routers: a swarm on the NAT testbed of tests/support/netns.py.

M public peers sit on the testbed's "Internet" bridge (10.90.0.0/24), N home peers each behind a router of their
own that masquerades and drops every new inbound connection; every host's link is shaped with `tc tbf`. The first
public host starts the run (a `ttt train` peer, or with --helpers K a `ttt monitor --assist-averaging` that only
helps, as do the next K - 1 public hosts), the others join it with the address it printed on the bridge. For every
peer the bench reports:

- full rounds: the share of its global steps whose gradient round held all training peers (and the helpers);
- failed rounds: steps that averaged with nobody while others were there, and the seconds lost: the steps'
  time beyond the peer's median full-round step (a round that cannot form waits up to --averaging-timeout);
- samples/s (contributed samples over the peer's whole run, start-up, state downloads and the final agreement
  included; the `ema` hivemind prints excludes averaging), the share of its time computing (forward and backward,
  optimizer steps; from its first batch to its end: the rest went to waiting for rounds and peers, state downloads,
  loading batches), and the bytes it sent
  (averaging, states served, as hivemind counts them; and on the wire: what left its link, relayed traffic and
  TCP/IP/TLS overhead included);
- partial rounds: rounds in which the peer received only part of its results, or as a reducer only part of the
  pieces (hivemind's own log says so; the progress line counts the group all the same);
- raw log lines: what hivemind printed on the console (its `[ERROR]`, `[WARN]`... lines, tracebacks);
- the addresses it announced (printed for others to join with), or "client" for a client-mode peer, and what its
  reachability check said ("behind NAT", "reachable", or a warning that it could not check);
- lost dials: connections it tried to open to private addresses (dropped by the "Internet"), and for a home peer,
  the packets its router dropped because they tried to open a connection from outside;
- with --kill NAME@STEP[+DELAY] (a volunteer's machine crashing, or its plug pulled: SIGKILL, no goodbye, DELAY
  seconds after it printed global step STEP), for each survivor: the step the kill fell in, its seconds beyond a
  typical full-round step, and its round's size; a full round after the kill is one of the survivors.

    PYTHONPATH=. python -m bench.wan --homes 2 --public 1 --rate 20mbit --steps 15 [--runs 3]
        [--home-args="--reachability public"] [--extra-args="--averaging-timeout 15"] [--helpers 2] [--scenario NAME]
        [--public-net 11.90.0] [--no-wait] [--preset small] [--kill home1@5+2.5]
        [--public-rates 100mbit,10mbit] [--declare-bandwidth]

Every peer waits for the others (--wait-for-peers) unless --no-wait. Figures go to bench/results/wan.json under
the scenario's name: a scenario's runs add up over invocations, each with its commit; other scenarios stay. Each
peer's whole output stays in --logs (hivemind's own log in NAME/hivemind.log beside it). `--home-args="--reachability
public"` gives the homes the behaviour of ttt before they checked their reachability (full peers, as a plain command
made them).
Each run takes 3-13 minutes on 2 cores; the machine must not be busy otherwise (a peer that falls behind on CPU
falls out of rounds like one that cannot be reached).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.common import CODE, RESULTS_DIR, ROOT, save_results
from tests.support.datasets import write_paper_scale, write_sample
from tests.support.netns import Testbed, can_build
from tests.support.swarm_runs import PARTIAL_ROUND, RAW_HIVEMIND, TTT, PeerLog, WanSwarm

SENT = re.compile(r"sent ([\d,]+) bytes to other peers \(averaging ([\d,]+), states served ([\d,]+)")
FINISHED = re.compile(r"contributed ([\d,]+) samples in (\d+) s")
COMPUTE = re.compile(r"computing (\d+)% of the time: forward and backward (\d+)%")
SPEED = re.compile(r"\| ([\d,.]+) samples/s")
ANNOUNCED = re.compile(r"^/ip4/\S+$", re.M)
REACHABILITY = re.compile(r"^(behind NAT|reachable|warning: could not check)", re.M)
console = Console(width=140)


def peer_options(args: argparse.Namespace, home: bool, trainers: int) -> list[str]:
    """A training peer's `ttt train` options beyond the run's: unless --no-wait, every peer waits until all are there
    (no peer trains alone while the others still start, which would count against the network)."""
    own = shlex.split(args.home_args if home else args.public_args)
    waiting = [] if args.no_wait else ["--wait-for-peers", str(trainers)]
    return [*waiting, *shlex.split(args.extra_args), *own]


def helper_argv(args: argparse.Namespace, folder: Path, name: str, joining: list[str]) -> list[str]:
    """A public helper, in every round, keeping the run's state (`ttt monitor --assist-averaging`); JOINING: how it
    finds the run (none for the first, which starts it)."""
    settings = ["--run-id", "wan", "--assist-averaging", "--checkpoint-every", "0", "--port", "18080"]
    own = [*joining, *shlex.split(args.helper_args)]
    return [TTT, "monitor", *settings, "--checkpoint-dir", str(folder / name), *own]


def public_rates(args: argparse.Namespace) -> tuple[str, ...]:
    """--public-rates: pub0's, pub1's... links, where they differ from --rate."""
    return tuple(args.public_rates.split(",")) if args.public_rates else ()


def declared_bandwidth(args: argparse.Namespace, host: str) -> list[str]:
    """With --declare-bandwidth, a public host's `--bandwidth`: its link's rate in Mbit/s (none for a home)."""
    if not args.declare_bandwidth or not host.startswith("pub"):
        return []
    rates = public_rates(args)
    index = int(host[3:])
    rate = rates[index] if index < len(rates) else args.rate
    if not rate.endswith("mbit"):
        raise SystemExit(f"--declare-bandwidth needs the public hosts' rates in mbit, not {rate}")
    return ["--bandwidth", rate.removesuffix("mbit")]


def step_durations(log: PeerLog) -> list[tuple[int, float]]:
    """(round size, seconds since the previous step) of each global step after the first one."""
    rounds = log.rounds
    return [(size, seen - rounds[k - 1][2]) for k, (_, size, seen) in enumerate(rounds) if k > 0]


def peer_figures(
    log: PeerLog, trainers: int, dropped: int | None, lost_dials: int, killed_at: float | None = None
) -> dict:
    """What one peer's output says about its run (see the module's docstring). After KILLED_AT (a peer was killed
    then), a full round is one of the others."""
    rounds, durations = log.rounds, step_durations(log)
    expected = [trainers - (killed_at is not None and seen > killed_at) for _, _, seen in rounds]
    speeds = [float(m.group(1).replace(",", "")) for _, line in log.lines if (m := SPEED.search(line))]
    full = [seconds for (size, seconds), peers in zip(durations, expected[1:], strict=True) if size == peers]
    typical = statistics.median(full) if full else statistics.median([s for _, s in durations] or [0.0])
    failed = [seconds for size, seconds in durations if size == 1]
    sent, finished = SENT.search(log.text), FINISHED.search(log.text)
    samples, seconds = (int(finished.group(1).replace(",", "")), int(finished.group(2))) if finished else (0, 0)
    raw = [line for _, line in log.lines if RAW_HIVEMIND.search(line)]
    return {
        "steps": len(rounds),
        "round_sizes": [size for _, size, _ in rounds],
        "full_rounds": sum(size == peers for (_, size, _), peers in zip(rounds, expected, strict=True)),
        "full_share": sum(size == peers for (_, size, _), peers in zip(rounds, expected, strict=True))
        / max(1, len(rounds)),
        "failed_rounds": len(failed),
        "lost_seconds": round(sum(max(0.0, s - typical) for _, s in durations), 1),
        "failed_seconds": round(sum(failed), 1),
        "typical_step_seconds": round(typical, 2),
        "mean_step_seconds": round(statistics.mean(s for _, s in durations), 2) if durations else None,
        "samples_per_second": samples / seconds if seconds else 0.0,
        "compute_samples_per_second": speeds[-1] if speeds else None,  # hivemind's EMA, averaging time excluded
        # the shares of its time from the first batch to the end spent computing (forward and backward, optimizer
        # steps) and in forward and backward alone (the final line's)
        "compute_share": int(compute.group(1)) / 100 if (compute := COMPUTE.search(log.text)) else None,
        "forward_backward_share": int(compute.group(2)) / 100 if compute else None,
        "sent_bytes": int(sent.group(1).replace(",", "")) if sent else None,
        "averaging_bytes": int(sent.group(2).replace(",", "")) if sent else None,
        "state_bytes": int(sent.group(3).replace(",", "")) if sent else None,
        "raw_log_lines": len(raw),
        "control_failures": sum("ControlFailure" in line for line in raw),
        "raw_log_examples": sorted({line[:240] for line in raw})[:6],
        "announced": ANNOUNCED.findall(log.text) or (["client"] if "client-mode peer" in log.text else []),
        "reachability": found.group(1) if (found := REACHABILITY.search(log.text)) else None,
        "dropped_inbound": dropped,
        "lost_dials": lost_dials,
        "exit": log.returncode,
        **({} if killed_at is None else kill_figures(rounds, durations, killed_at, typical)),
    }


def kill_figures(
    rounds: list[tuple[int, int, float]], durations: list[tuple[int, float]], killed_at: float, typical: float
) -> dict:
    """What the kill cost a survivor (its ROUNDS and their step DURATIONS): the step that ended first after it (its
    round broke, or formed without the killed peer), its time beyond the typical full-round step, and the size of
    that step's round."""
    steps = zip(durations, rounds[1:], strict=True)
    after = [(size, seconds) for (size, seconds), (_, _, seen) in steps if seen > killed_at]
    if not after:
        return {"kill_step_seconds": None, "kill_lost_seconds": None, "kill_step_round": None}
    size, seconds = after[0]
    return {"kill_step_seconds": round(seconds, 1), "kill_lost_seconds": round(max(0.0, seconds - typical), 1),
            "kill_step_round": size}  # fmt: skip


def one_run(args: argparse.Namespace, folder: Path) -> dict:
    """Build the testbed, run the swarm to its end (or --timeout), take the figures, remove the testbed."""
    trainers = [f"pub{i}" for i in range(args.helpers, args.public)] + [f"home{j}" for j in range(args.homes)]
    helpers = [f"helper{k}" if k else "helper" for k in range(args.helpers)]  # on pub0, pub1...
    shaping = {"uplink": args.rate, "downlink": args.downlink or args.rate}
    shaping["public_rates"] = public_rates(args)
    run = ["--dataset", args.dataset, "--run-id", "wan", "--max-steps", str(args.steps), "--threads", "1"]
    run += ["--loader-workers", "0", "--preset", args.preset]
    with Testbed(public=args.public, homes=args.homes, public_net=args.public_net, **shaping) as net:
        swarm = WanSwarm(net, folder, run)
        started = time.monotonic()
        for k, name in enumerate(helpers):
            joining = ["--initial-peers", swarm.address] if k else []
            argv = [*helper_argv(args, folder, name, joining), *declared_bandwidth(args, f"pub{k}")]
            swarm.launch(name, argv, env=CODE, host=f"pub{k}")
        for name in trainers:
            own = [*peer_options(args, name.startswith("home"), len(trainers)), *declared_bandwidth(args, name)]
            swarm.start(name, *own, env=CODE)
        killed_at = kill_when_due(swarm, args.kill) if args.kill else None
        survivors = [name for name in trainers if not args.kill or name != args.kill[0]]
        completed = swarm.wait_for_exit(survivors, args.timeout - (time.monotonic() - started))
        wall = time.monotonic() - started
        dropped = {name: net.dropped_inbound(name) for name in trainers if name.startswith("home")}
        lost, wire = net.lost_dials(), net.wire_bytes()
    swarm.read()
    peers = {
        # a full round: every training peer, and the helpers, which join every group they can
        name: peer_figures(
            swarm.logs[name], len(trainers) + args.helpers, dropped.get(name), lost.get(name, 0), killed_at
        )
        for name in survivors
    }
    for name, figures in peers.items():  # what went over its link, relayed traffic and overhead included
        figures["partial_rounds"] = len(PARTIAL_ROUND.findall((folder / name / "hivemind.log").read_text()))
        figures["wire_sent_bytes"], figures["wire_received_bytes"] = wire[name]["sent"], wire[name]["received"]
    helper = {"helpers_wire": [wire[f"pub{k}"] for k in range(args.helpers)]} if args.helpers else {}
    return {"completed": completed, "seconds": round(wall, 1), "peers": peers, **helper}


def kill_when_due(swarm: WanSwarm, kill: tuple[str, int, float]) -> float:
    """SIGKILL peer NAME (its process group: no goodbye, as a crash or a pulled plug) DELAY seconds after it
    printed global step STEP; the moment of the kill."""
    name, step, delay = kill
    swarm.wait_for_step(name, step, timeout=900)
    time.sleep(delay)
    swarm.kill(name)
    return time.monotonic()


def parse_kill(text: str) -> tuple[str, int, float]:
    """NAME@STEP[+DELAY], e.g. home1@5+2.5: kill home1 2.5 s after its step 5."""
    found = re.fullmatch(r"(\w+)@(\d+)(?:\+([\d.]+))?", text)
    if not found:
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME@STEP[+DELAY], e.g. home1@5+2.5")
    return found.group(1), int(found.group(2)), float(found.group(3) or 0.0)


def make_dataset(preset: str, folder: Path) -> str:
    """A dataset the PRESET trains on: the embedded sample (tiny), or random codes at the paper's scale (small)."""
    if not folder.exists():
        if preset == "tiny":
            write_sample(folder, 200)
        else:
            write_paper_scale(folder, 2048, grid=32, compression_level=1)
    return str(folder)


def commit() -> str:
    """The worktree's commit, for the record of a run."""
    return subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()


def earlier_runs(scenario: str) -> list[dict]:
    """The runs bench/results/wan.json already holds for SCENARIO: a scenario's runs add up over invocations."""
    path = RESULTS_DIR / "wan.json"
    return json.loads(path.read_text()).get(scenario, {}).get("runs", []) if path.exists() else []


def summary(runs: list[dict]) -> dict:
    """Per-peer-kind means over the runs: public and home peers each."""
    out = {}
    for kind in ("pub", "home"):
        figures = [p for run in runs for name, p in run["peers"].items() if name.startswith(kind)]
        if not figures:
            continue
        mean = lambda key, rows=figures: statistics.mean(p.get(key) or 0 for p in rows)  # noqa: E731
        out[kind] = {
            key: round(mean(key), 3)
            for key in (
                "full_share",
                "failed_rounds",
                "partial_rounds",
                "lost_seconds",
                "samples_per_second",
                "compute_share",
                "raw_log_lines",
                "control_failures",
                "lost_dials",
                "mean_step_seconds",
                "kill_lost_seconds",
            )
        }
        out[kind]["sent_mb"] = round(mean("sent_bytes") / 1e6, 1)
        out[kind]["state_mb"] = round(mean("state_bytes") / 1e6, 1)
        out[kind]["wire_sent_mb"] = round(mean("wire_sent_bytes") / 1e6, 1)
    return out


def show(scenario: str, runs: list[dict]) -> None:
    table = Table(title=f"{scenario}: {len(runs)} run(s)")
    for column in ("run", "peer", "steps", "full rounds", "partial", "failed", "lost s", "samples/s", "compute",
                   "sent MB", "avg MB", "states MB", "raw log", "lost dials", "dropped in", "announced",
                   "kill's step"):  # fmt: skip
        table.add_column(column, overflow="fold")
    for k, run in enumerate(runs):
        for name, p in run["peers"].items():
            mb = lambda key, p=p: f"{(p[key] or 0) / 1e6:.1f}"  # noqa: E731
            table.add_row(
                f"{k + 1}{'' if run['completed'] else ' (timeout)'}", name, str(p["steps"]),
                f"{p['full_rounds']} ({p['full_share']:.0%})", str(p.get("partial_rounds", "-")),
                str(p["failed_rounds"]), f"{p['lost_seconds']:.0f}",
                f"{p['samples_per_second']:.1f}", f"{p['compute_share'] or 0:.0%}", mb("sent_bytes"),
                mb("averaging_bytes"), mb("state_bytes"),
                str(p["raw_log_lines"]), str(p["lost_dials"]),
                str(p["dropped_inbound"] if p["dropped_inbound"] is not None else "-"),
                " ".join(a.split("/p2p/")[0] for a in p["announced"]),
                kill_cell(p),
            )  # fmt: skip
    console.print(table)
    for k, run in enumerate(runs):
        if run.get("helpers_wire"):
            steps = max(p["steps"] for p in run["peers"].values()) or 1
            each = ", ".join(f"{wire['sent'] / 1e6:.1f} MB ({wire['sent'] / steps / 1e6:.2f} MB per global step)"
                             for wire in run["helpers_wire"])  # fmt: skip
            console.print(f"run {k + 1}: the helpers sent {each} on the wire")


def kill_cell(peer: dict) -> str:
    """The step a kill fell in, for the table: its seconds, those beyond a typical step, its round's size."""
    if peer.get("kill_step_seconds") is None:
        return "-"
    return f"{peer['kill_step_seconds']:.1f} s (+{peer['kill_lost_seconds']:.1f}), round {peer['kill_step_round']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--homes", type=int, default=2, help="home peers, each behind a NAT router of its own")
    parser.add_argument("--public", type=int, default=1, help="public hosts (the first one starts the run)")
    parser.add_argument("--rate", default="20mbit", help="every host's uplink, a tc rate; 'none': not shaped")
    parser.add_argument("--downlink", default=None, help="every host's downlink [default: --rate]")
    parser.add_argument("--public-rates", default="", help="RATE,RATE...: pub0's, pub1's... links both ways")
    parser.add_argument("--declare-bandwidth", action="store_true", help="public peers pass their rate as --bandwidth")
    parser.add_argument("--steps", type=int, default=15, help="global steps (--max-steps) of every peer")
    parser.add_argument("--runs", type=int, default=1, help="repetitions of the scenario")
    parser.add_argument("--extra-args", default="", help="more `ttt train` options for every training peer")
    parser.add_argument("--home-args", default="", help="more options for the home peers (e.g. --reachability client)")
    parser.add_argument("--public-args", default="", help="more options for the public training peers")
    parser.add_argument("--helpers", type=int, default=0, help="pub0, pub1... run `ttt monitor --assist-averaging`")
    parser.add_argument("--helper-args", default="", help="more options for the helper")
    parser.add_argument("--no-wait", action="store_true", help="no --wait-for-peers: the first peer starts alone")
    parser.add_argument("--public-net", default="10.90.0", help="the bridge's /24 (10.x counts as private to libp2p)")
    parser.add_argument("--preset", default="tiny", choices=("tiny", "small"), help="the peers' model")
    parser.add_argument("--dataset", default=None, help="[default: made in --logs: 200 rows of the embedded sample "
                        "for tiny, 2,048 rows of random 32x32 codes for small]")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a run may take before it is stopped")
    parser.add_argument("--kill", type=parse_kill, default=None, help="NAME@STEP[+DELAY]: SIGKILL that peer DELAY s "
                        "after its global step STEP; figures for the survivors, the kill's step apart")
    parser.add_argument("--scenario", default=None, help="its name in bench/results/wan.json")
    parser.add_argument("--logs", default=None, help="folder for every peer's output [default: a temporary one]")
    args = parser.parse_args()
    args.rate = None if args.rate == "none" else args.rate
    if (why := can_build()) is not None:
        sys.exit(f"cannot build the NAT testbed: {why}")
    scenario = args.scenario or " ".join(
        [f"{args.public}pub-{args.homes}home-{args.rate}", *([args.preset] if args.preset != "tiny" else []),
         args.extra_args, args.home_args]
    )
    logs = Path(args.logs or tempfile.mkdtemp(prefix="ttt-wan-"))
    args.dataset = args.dataset or make_dataset(args.preset, logs / "dataset")
    started, runs = time.perf_counter(), []
    for k in range(args.runs):
        runs.append({**one_run(args, logs / f"run{k + 1}"), "commit": commit()})
        console.print(f"run {k + 1}: {runs[-1]['seconds']} s; logs in {logs / f'run{k + 1}'}")
    show(scenario, runs)
    console.print(summary(runs))
    settings = {key: value for key, value in vars(args).items() if key not in ("logs",)}
    runs = earlier_runs(scenario) + runs
    results = {scenario: {"settings": settings, "runs": runs, "summary": summary(runs)}}
    save_results("wan", results, started, console, keep_other_parts=True)


if __name__ == "__main__":
    main()
