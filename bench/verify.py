"""Benchmark of checked work (training/audit/, docs/training.md#checked-work): how soon the audits convict an
attacker, and whether they ever convict an honest peer.

For each scenario and each of --runs runs: --honest honest `ttt train` peers of the tiny preset on the embedded
sample, on 127.0.0.1, and (but in the attacker-free runs) one tests/support/faulty_peer.py peer, every peer at
--audit-rate (the peers' default unless given), for --steps global steps. The attackers:

    free rider       sends zeros (its gradients x 0) and claims what it processed
    quiet poisoner   sends its gradients x -9 (under the 10x-median drop) and claims twice what it processed
    copycat          sends, for each microbatch, the gradient of its previous one (an earlier gradient replayed)
    false accuser    trains honestly, audits at every step and fails whatever it checks (its recomputation negated)
    sketch liar      commits the honest sketches of its microbatches, and sends its gradients x -9
    wrong rows       trains honestly on rows of row groups its leased blocks do not hold, and commits to them
    out of sight     honest until global step 8 (proven by the audits meanwhile), then commits under a lineage of its
                     own, which no auditor holds, and sends its gradients x -9 (a quiet poisoner the audits never
                     recompute again: the reducers count it for nothing once its last steps match nobody's lineage)

Each but the sketch liar commits to what it sends (its sketches are of the gradients it sends); the sketch liar is for
the reducers' checks (training/audit/received.py), the wrong rows for the lease check (training/audit/leased.py).
From the peers' logs, per run:

    convicted at     the global step at which each honest peer convicted the attacker (that of its last progress line
                     before its "convicted" line); "-": never
    left out at      the global step at which each honest peer's reducers left the attacker out because nobody could
                     audit it (its line "commits under lineages no other peer holds"); "-": never
    honest left out  the honest peers that honest peers left out so (apart from the others for their last steps)
    rounds after     the honest peers' rounds that still held the attacker after they convicted it (a home's: after
                     every helper had), in all
    honest convicted the honest peers that any peer convicted (the goal: none)
    honest failed    the failed verdicts that honest peers and helpers published against honest peers (a run with
                     any keeps its peers' logs in bench/results/verify-logs/, to be traced)
    accusations      the failed verdicts the attacker published (its log's lines)
    withheld         the steps at which an honest peer or helper found its own parameters off (another peer's
                     microbatch failed too: training/audit/auditor.py's `own_parameters_off`) and judged nothing
    loss             the honest peers' mean loss at the last step, and its ratio to the attacker-free runs' mean

Prints a table and writes every figure to bench/results/verify.json.

    .venv/bin/python -m bench.verify [--runs 3] [--steps 30] [--honest 4] [--audit-rate 0.1] [--only copycat]
                                     [--mixed-threads] [--helpers 2] [--helper-audit-rate 1]

With --helpers N, the run is a run of homes: every trainer, the attacker too, joins in client mode (nobody can dial
it, as behind NAT: on 127.0.0.1 here, tests/test_wan.py has the real NAT), and N public helpers (`ttt monitor
--assist-averaging`) are its only reducers; "convicted at" then also has each helper's column. With
--helper-audit-rate R the helpers also recompute the others' work from the run's dataset (`ttt monitor --audit-rate
R`): an audit at that share of their global steps, and a re-check of every failed verdict.

With --mixed-threads, every other honest peer computes with 2 torch threads (the others and the attacker with 1): an
auditor then recomputes with another thread count than the peer it checks, whose sums are ordered differently (the
tolerance's other source of nondeterminism). `--only '' --steps 300 --mixed-threads` is the long honest run.
"""

from __future__ import annotations

import argparse
import logging
import re
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.common import RESULTS_DIR, save_results
from tests.support.commands import SWARM_ARGS
from tests.support.datasets import write_sample
from tests.support.swarm_runs import ADDRESS, TTT, PeerLog, SwarmRun, free_port

console = Console()
ATTACKERS = {
    "free-rider": ("free rider", "scale:0"),
    "poisoner": ("quiet poisoner", "scale:-9+claim:2"),
    "copycat": ("copycat", "replay"),
    "false-accuser": ("false accuser", "accuse"),
    "sketch-liar": ("sketch liar", "lie"),
    "wrong-rows": ("wrong rows", "rows"),
    "out-of-sight": ("out of sight", "hide:8"),
}
CONVICTED = re.compile(r"^audit: \.\.\.(\w+) convicted by")
LEFT_OUT = re.compile(r"^audit: \.\.\.(\w+) commits under lineages no other peer holds")
STEP = re.compile(r"^(?:outer )?step\s+(\d+) \|")  # a trainer's progress line, or a monitor's
HOME = r"client-mode peer \w+"  # a home's line naming its peer id
# A failed verdict a peer published: an audit's or a lease check's (ACCUSED), or also a reducer's check's (FAILED,
# group 1: the accused).
AUDIT_FAILED = r"'s microbatch \d+ of step \d+ (is not what it committed|was not its to read)"
ACCUSED = re.compile(rf"^audit: \.\.\.\w+{AUDIT_FAILED}")
FAILED = re.compile(rf"^audit: \.\.\.(\w+)({AUDIT_FAILED}| sent this reducer something else| claimed [\d.e+]+ samples)")
WITHHELD = re.compile(r"^audit: this peer's parameters of step \d+ are not its lineage's")
SAMPLE_ROWS = 1200


def swarm_run(folder: Path, dataset: Path, args: argparse.Namespace, fault: str | None) -> tuple[dict, str | None]:
    """One run of the honest peers (and the helpers) and, with `fault`, the attacker: every peer's log, and the
    attacker's peer id's last 8 characters (as the audits' lines name it)."""
    audit_rate = ["--audit-rate", str(args.audit_rate)] if args.audit_rate is not None else []
    run = SwarmRun(
        folder,
        ["--dataset", str(dataset), "--run-id", "verify", "--max-steps", str(args.steps), *audit_rate, *SWARM_ARGS],
    )
    honest = [f"h{i}" for i in range(args.honest)]
    threads = [["--threads", "2"] if args.mixed_threads and i % 2 else [] for i in range(args.honest)]
    home = ["--reachability", "client"] if args.helpers else []
    for number in range(args.helpers):  # the first helper starts the swarm: homes cannot be joined through
        helper = ["monitor", "--run-id", "verify", "--assist-averaging", "--port", str(free_port()),
                  "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--checkpoint-dir", str(folder / f"helper{number}"),
                  "--dataset", str(dataset), "--audit-rate", str(args.helper_audit_rate)]
        run.launch(f"helper{number}", [TTT, *helper, *(["--initial-peers", run.address] if run.address else [])])
    run.start(honest[0], *home, "--wait-for-peers", str(args.honest + (fault is not None)))
    for name, extra in zip(honest[1:], threads[1:], strict=True):
        run.start(name, *home, *extra)
    attacker = None
    if fault:
        run.start("x", *home, fault=fault)
        attacker = re.split(r"[/ ]", run.wait_for("x", HOME if args.helpers else ADDRESS).group(0))[-1][-8:]
    # A convicted home cannot go on (nobody it can reach serves it the state): the honest trainers' end is the run's.
    waited = [*honest, *(["x"] if fault and not args.helpers else [])]
    if not run.wait_for_exit(waited, timeout=60 * args.steps):
        raise SystemExit(f"the run did not finish within {60 * args.steps} s:\n{run.stop_stragglers()}")
    if fault and run.processes["x"].poll() is None:
        run.kill("x")
    for number in range(args.helpers):
        run.kill(f"helper{number}", signal.SIGINT)
    return run.finish(timeout=120), attacker


def first_said(log: PeerLog, said: re.Pattern) -> dict[str, int]:
    """Peer named (its peer id's last 8 characters, `said`'s group 1) -> the global step of this peer's (or
    helper's) last progress line before its first line that `said` matches: when it convicted (CONVICTED) or left
    out (LEFT_OUT) that peer."""
    step, found = 0, {}
    for _, line in log.lines:
        progress = STEP.match(line)
        if progress:
            step = int(progress.group(1))
        named = said.match(line)
        if named:
            found.setdefault(named.group(1), step)
    return found


def run_row(logs: dict[str, PeerLog], attacker: str | None, honest: int, helpers: int) -> dict:
    """What one run's logs say (the module's docstring)."""
    names = [f"h{i}" for i in range(honest)]
    judges = [*names, *(f"helper{i}" for i in range(helpers))]  # the honest peers and helpers
    convicted = {name: first_said(logs[name], CONVICTED) for name in logs}
    caught = {name: convicted[name].get(attacker) for name in judges}
    left_out = {name: first_said(logs[name], LEFT_OUT) for name in judges}
    # From when it convicted the attacker; a home, which reduces nothing, from when every helper had.
    by_helpers = [caught[f"helper{i}"] for i in range(helpers)]
    refused_from = {
        name: caught[name] if not helpers else None if None in by_helpers else max(by_helpers) for name in names
    }
    rounds_after = sum(
        1
        for name in names
        if refused_from[name] is not None
        for step, size, _ in logs[name].rounds
        if step > refused_from[name] and size > honest + helpers
    )
    wrongly = sorted({accused for name in logs for accused in convicted[name] if accused != attacker})
    losses = [logs[name].losses for name in names]
    last = max(set.intersection(*(set(loss) for loss in losses)))
    return {
        "convicted_at": caught,
        "left_out_at": {name: found.get(attacker) for name, found in left_out.items()},
        "honest_left_out": sorted({peer for found in left_out.values() for peer in found if peer != attacker}),
        "rounds_after": rounds_after,
        "honest_convicted": wrongly,
        "accusations": sum(1 for _, line in logs["x"].lines if ACCUSED.match(line)) if "x" in logs else 0,
        "honest_failed": [
            f"{name}: {line}"
            for name in judges
            for _, line in logs[name].lines
            if (failed := FAILED.match(line)) and failed.group(1) != attacker
        ],
        "withheld": sum(1 for name in judges for _, line in logs[name].lines if WITHHELD.match(line)),
        "loss": statistics.mean(loss[last] for loss in losses),
        "exit_codes": {name: log.returncode for name, log in logs.items()},
    }


def keep_logs(folder: Path, kept: Path) -> None:
    """Copy a run's peers' logs out of the bench's temporary folder, to be traced."""
    kept.mkdir(parents=True, exist_ok=True)
    for log in folder.glob("*.log"):
        shutil.copy(log, kept / log.name)
    console.print(f"  failed or withheld verdicts about honest peers: the peers' logs are in {kept}")


def bench(args: argparse.Namespace) -> dict:
    scenarios = {"none": ("no attacker", None)} | {key: ATTACKERS[key] for key in args.only.split(",") if key}
    results = {}
    with tempfile.TemporaryDirectory(prefix="ttt-bench-verify-") as tmp:
        tmp = Path(tmp)
        write_sample(tmp / "sample", SAMPLE_ROWS)
        for key, (title, fault) in scenarios.items():
            results[key] = []
            for number in range(args.runs):
                started = time.monotonic()
                logs, attacker = swarm_run(tmp / f"{key}-{number}", tmp / "sample", args, fault)
                row = run_row(logs, attacker, args.honest, args.helpers) | {"seconds": time.monotonic() - started}
                if row["honest_failed"] or row["honest_convicted"] or row["withheld"]:
                    keep_logs(tmp / f"{key}-{number}", RESULTS_DIR / "verify-logs" / f"{key}-{number}")
                console.print(f"  {title}, run {number + 1}: {row}")
                results[key].append(row)
    return results


def steps_line(steps: dict[str, int | None]) -> str:
    """Each peer's step ("-": none), as a table's cell."""
    return " ".join("-" if step is None else str(step) for step in steps.values())


def print_results(results: dict, honest: int) -> None:
    baseline = statistics.mean(row["loss"] for row in results["none"])
    table = Table(title=f"{honest} honest peers and one attacker (tiny): when the audits convict it")
    for column in ("attacker", "run", "convicted at (each honest peer, helper)", "left out at", "rounds after",
                   "honest convicted", "honest failed", "honest left out", "withheld", "accusations", "loss",
                   "vs no attacker"):  # fmt: skip
        table.add_column(column, justify="right")
    for key, rows in results.items():
        title = ATTACKERS[key][0] if key in ATTACKERS else "none"
        for number, row in enumerate(rows, 1):
            attacked = key in ATTACKERS
            caught, left = (steps_line(row[column]) if attacked else "" for column in ("convicted_at", "left_out_at"))
            table.add_row(
                title, str(number), caught, left, str(row["rounds_after"]), str(len(row["honest_convicted"])),
                str(len(row["honest_failed"])), str(len(row["honest_left_out"])), str(row["withheld"]),
                str(row["accusations"]),
                f"{row['loss']:.4f}",
                f"{row['loss'] / baseline:.3f}",
            )  # fmt: skip
    console.print(table)


def main() -> None:
    logging.getLogger("hivemind").setLevel(logging.CRITICAL)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="runs of each scenario")
    parser.add_argument("--steps", type=int, default=30, help="global steps of each run")
    parser.add_argument("--honest", type=int, default=4, help="honest peers in each run")
    parser.add_argument("--audit-rate", type=float, default=None, help="every peer's --audit-rate [the default]")
    parser.add_argument("--only", default=",".join(ATTACKERS), help="comma-separated attackers to run ('': none)")
    parser.add_argument(
        "--mixed-threads", action="store_true", help="every other honest peer computes with 2 torch threads, not 1"
    )
    parser.add_argument("--helpers", type=int, default=0, help="public helpers, every trainer a home (client mode)")
    parser.add_argument(
        "--helper-audit-rate", type=float, default=0.0, help="the helpers' --audit-rate (0: they recompute nothing)"
    )
    args = parser.parse_args()
    started = time.perf_counter()
    results = bench(args)
    print_results(results, args.honest)
    save_results("verify", {"settings": vars(args), "runs": results}, started, console)


if __name__ == "__main__":
    main()
