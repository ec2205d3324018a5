"""A crowd on one machine: N `ttt train` peers of the tiny preset on the NAT testbed, arriving, dying and joining.

    PYTHONPATH=. python -m bench.scale [--sizes 8 16 32] [--minutes 6] [--churn 120] [--helpers 1]

For each N: a quarter of the trainers behind home routers (NAT; 20 Mbit/s both ways), the rest public and unshaped,
and --helpers public `ttt monitor --assist-averaging` helpers. The first helper starts the run from its spec (`ttt
run init`: target batch 16 samples per trainer, so that every N computes the same samples per peer and step) and
serves the dashboard; every trainer joins with `ttt train --join http://HELPER:18080`, one every --arrival seconds
(a crowd does not start at once). Every --churn seconds one trainer is SIGKILLed (no goodbye) and a new one joins
on its machine. After --minutes every survivor leaves with Ctrl-C. Figures per N:

- rounds: for each global step, the share of the live trainers (synchronised, not killed; and the helpers) that
  its round held, and the share of steps in which it held at least 90% of them;
- step time (median seconds between global steps) and waiting time per step (a survivor's step time it did not
  compute: matchmaking, averaging, state downloads; from its final line's computing share);
- bytes per trainer and global step: averaging and states served (as hivemind counts them), and on the wire (what
  left its machine's link: DHT, TCP and TLS included); each helper's wire bytes per step;
- memory per trainer: private and proportional (Pss) bytes of its processes, and its processes by kind;
- background CPU per trainer: CPU seconds per second of its processes other than the main one (hivemind's DHT and
  averagers, p2pd, torch's shm manager);
- joiners: seconds from launch to the state download, and to the first round with others;
- the monitor: /api/state latency (median of 20 reads) and the dashboard in chromium (a screenshot per N).

Results in bench/results/scale.json (screenshots beside it, in scale-N.png); the table in docs/performance.md.
The machine must not be busy otherwise: a peer short of CPU falls out of rounds as one that cannot be reached.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.common import CODE, save_results
from bench.wan import COMPUTE, FINISHED, SENT, commit, make_dataset
from tests.support.netns import Testbed, can_build
from tests.support.swarm_runs import TTT, PeerLog, WanSwarm

PORT = 18080  # the helpers' dashboards
SAMPLES_PER_TRAINER = 16  # per global step: the target batch is this times N
TRAINER_ARGS = ["--threads", "1", "--loader-workers", "0"]  # N peers on a 2-core machine
console = Console(width=160)


def machines(n: int, helpers: int) -> tuple[list[str], list[str]]:
    """The testbed hosts of the helpers and of the N trainers: a quarter of the trainers at home."""
    homes = n // 4
    trainers = [f"pub{helpers + i}" for i in range(n - homes)] + [f"home{j}" for j in range(homes)]
    return [f"pub{i}" for i in range(helpers)], trainers


def start_helpers(swarm: WanSwarm, folder: Path, dataset: str, n: int, helpers: list[str]) -> str:
    """The run's spec, then its helpers (the first starts the run); the URL trainers join with."""
    spec = folder / "run.toml"
    target = str(n * SAMPLES_PER_TRAINER)
    init = ["run", "init", "--run-id", "scale", "--dataset", dataset, "--target-batch-size", target, "--out-file"]
    subprocess.run([TTT, *init, str(spec)], check=True, capture_output=True)
    for k, host in enumerate(helpers):
        joining = ["--initial-peers", swarm.address] if k else []
        argv = [TTT, "monitor", "--run", str(spec), "--assist-averaging", "--host", "0.0.0.0", "--port", str(PORT),
                "--checkpoint-every", "0", "--checkpoint-dir", str(folder / host), *joining]  # fmt: skip
        swarm.launch(host, argv, env=CODE, host=host)
    return f"http://{swarm.net.hosts[helpers[0]].address}:{PORT}"


def launch_trainer(swarm: WanSwarm, name: str, host: str, url: str) -> float:
    """`ttt train --join URL` as NAME on HOST; when it started."""
    argv = [TTT, "train", "--join", url, "--name", name, "--checkpoint-dir", str(swarm.folder / name), *TRAINER_ARGS]
    swarm.launch(name, argv, env=CODE, host=host)
    return time.monotonic()


def process_tree(pid: int) -> list[int]:
    """PID and every process below it."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, pending = [], [pid]
    while pending:
        tree.append(pending.pop())
        pending += children.get(tree[-1], [])
    return tree


def process_reading(process: int) -> tuple[str, int, int, float] | None:
    """A process's command name, private and proportional bytes, and CPU seconds so far; None if it has ended."""
    try:
        rollup = Path(f"/proc/{process}/smaps_rollup").read_text().splitlines()
        stat = Path(f"/proc/{process}/stat").read_text().rsplit(")", 1)[1].split()
        name = Path(f"/proc/{process}/comm").read_text().strip()
    except OSError:
        return None
    values = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in rollup[1:]}
    private = values.get("Private_Clean", 0) + values.get("Private_Dirty", 0)
    return name, private, values.get("Pss", 0), (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


def process_figures(pid: int) -> dict:
    """Of PID's process tree: private and proportional bytes, CPU seconds of the main process and of the others, and
    the processes by kind (their command's name)."""
    private = pss = 0
    cpu = {"main": 0.0, "background": 0.0}
    kinds: dict[str, int] = {}
    for process in process_tree(pid):
        if (reading := process_reading(process)) is None:
            continue
        name, its_private, its_pss, its_cpu = reading
        private, pss = private + its_private, pss + its_pss
        cpu["main" if process == pid else "background"] += its_cpu
        kinds[name] = kinds.get(name, 0) + 1
    return {"private": private, "pss": pss, "cpu": cpu, "processes": kinds}


def sample_processes(swarm: WanSwarm, names: list[str], seconds: float = 20.0) -> dict[str, dict]:
    """Memory and processes of each live trainer of NAMES, and its CPU per second over SECONDS."""
    first = {name: process_figures(swarm.processes[name].pid) for name in names}
    time.sleep(seconds)
    figures = {}
    for name in names:
        last = process_figures(swarm.processes[name].pid)
        if swarm.processes[name].poll() is not None:
            continue  # killed meanwhile
        rates = {kind: (last["cpu"][kind] - first[name]["cpu"][kind]) / seconds for kind in ("main", "background")}
        figures[name] = {**last, "cpu_per_second": rates}
    return figures


def churn_and_sample(swarm: WanSwarm, args: argparse.Namespace, trainers: dict, url: str, started: float) -> dict:
    """Until --minutes after the first trainer's start: every --churn seconds one synchronised trainer SIGKILLed
    and a new one launched on its host; halfway, the trainers' processes sampled. Returns what happened."""
    chance, killed, joined, sampled = random.Random(args.seed), {}, {}, {}
    next_churn, deadline = started + args.churn, started + args.minutes * 60
    while time.monotonic() < deadline:
        swarm.read()
        if not sampled and time.monotonic() > started + args.minutes * 30:
            live = [name for name in trainers if name not in killed and swarm.processes[name].poll() is None]
            sampled = sample_processes(swarm, live)
        if time.monotonic() >= next_churn:
            ready = [name for name in trainers if name not in killed and swarm.logs[name].synchronised]
            victim = chance.choice(sorted(ready))
            swarm.kill(victim)
            killed[victim] = time.monotonic()
            newcomer = f"join{len(joined) + 1}"
            joined[newcomer] = launch_trainer(swarm, newcomer, trainers[victim]["host"], url)
            trainers[newcomer] = {"host": trainers[victim]["host"], "launched": joined[newcomer]}
            next_churn += args.churn
        time.sleep(1)
    return {"killed": killed, "joined": joined, "sampled": sampled}


def monitor_figures(net: Testbed, helper: str, url: str, screenshot: Path) -> dict:
    """/api/state's latency (20 reads from another host) and the dashboard drawn in chromium (as seen from there)."""
    probe = (
        "import json, statistics, time, urllib.request\n"
        f"times = []\nfor _ in range(20):\n    t = time.perf_counter()\n"
        f"    state = json.load(urllib.request.urlopen('{url}/api/state', timeout=30))\n"
        "    times.append(time.perf_counter() - t)\n"
        "print(json.dumps({'median': statistics.median(times), 'max': max(times), 'peers': len(state['peers']),"
        " 'bytes': len(json.dumps(state))}))\n"
    )
    drawn = (
        "from pathlib import Path; from tests.support.browser import open_dashboard; import time\n"
        f"t = time.perf_counter(); page = open_dashboard('{url}/', Path('{screenshot}'))\n"
        "print(round(time.perf_counter() - t, 2), len(page['errors']))\n"
    )
    try:
        timed = net.run(helper, [sys.executable, "-c", probe], timeout=300)
        latency = json.loads(timed.stdout) if timed.returncode == 0 else {"error": timed.stderr[-400:]}
    except subprocess.TimeoutExpired:  # a machine too busy to answer is a figure too
        latency = {"error": "20 reads took more than 300 s"}
    try:
        rendered = net.run(helper, [sys.executable, "-c", drawn], timeout=300)
        seconds, errors = rendered.stdout.split() if rendered.returncode == 0 else (None, rendered.stderr[-400:])
    except subprocess.TimeoutExpired:
        seconds, errors = None, "chromium did not draw the dashboard within 300 s"
    return {"api_state": latency, "dashboard_seconds": seconds, "dashboard_errors": errors}


def live_at(moment: float, trainers: dict, logs: dict[str, PeerLog], killed: dict[str, float]) -> int:
    """Trainers synchronised with the run at MOMENT and not killed before it."""
    return sum(
        1
        for name in trainers
        if logs[name].synchronised and logs[name].synchronised[1] <= moment < killed.get(name, float("inf"))
    )


def round_figures(trainers: dict, logs: dict[str, PeerLog], killed: dict[str, float], helpers: int) -> dict:
    """Each global step's round against the live trainers (and helpers), and the time between steps."""
    steps: dict[int, tuple[int, float]] = {}
    for name in trainers:
        for step, size, seen in logs[name].rounds:
            if size and (step not in steps or size > steps[step][0]):
                steps[step] = (size, min(seen, steps.get(step, (0, seen))[1]))
    shares = [min(1.0, size / (live_at(seen, trainers, logs, killed) + helpers)) for size, seen in steps.values()]
    times = sorted(seen for _, seen in steps.values())
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return {
        "global_steps": len(steps),
        "live_share_median": round(statistics.median(shares), 3) if shares else None,
        "steps_with_90_percent": round(sum(share >= 0.9 for share in shares) / len(shares), 3) if shares else None,
        "step_seconds_median": round(statistics.median(gaps), 2) if gaps else None,
        "round_sizes": [steps[step][0] for step in sorted(steps)],
    }


def survivor_figures(log: PeerLog, wire: dict[str, int] | None) -> dict | None:
    """What a survivor's final line says per global step: its waiting time and the bytes it sent."""
    sent, finished, compute = SENT.search(log.text), FINISHED.search(log.text), COMPUTE.search(log.text)
    steps = len(log.rounds)
    if not (sent and finished and compute and steps > 1):
        return None
    seconds = int(finished.group(2))
    number = lambda found, k: int(found.group(k).replace(",", ""))  # noqa: E731
    return {
        "steps": steps,
        "waiting_seconds_per_step": round(seconds * (1 - int(compute.group(1)) / 100) / steps, 2),
        "averaging_bytes_per_step": number(sent, 2) // steps,
        "state_bytes_per_step": number(sent, 3) // steps,
        "wire_sent_bytes_per_step": wire["sent"] // steps if wire else None,
    }


def joiner_figures(name: str, launched: float, log: PeerLog) -> dict:
    synchronised, together = log.synchronised, log.first_round_together
    return {
        "name": name,
        "to_state": round(synchronised[1] - launched, 1) if synchronised else None,
        "to_first_round": round(together[1] - launched, 1) if together else None,
    }


def one_size(args: argparse.Namespace, n: int, folder: Path) -> dict:
    """Build the testbed for N trainers, run the crowd, take the figures, remove the testbed."""
    helpers, hosts = machines(n, args.helpers)
    shaping = {"home_rate": args.home_rate}
    with Testbed(public=args.helpers + n - n // 4, homes=n // 4, **shaping) as net:
        swarm = WanSwarm(net, folder, [])
        url = start_helpers(swarm, folder, args.dataset, n, helpers)
        trainers = {}
        for host in hosts:
            trainers[host] = {"host": host, "launched": launch_trainer(swarm, host, host, url)}
            time.sleep(args.arrival)
        started = min(t["launched"] for t in trainers.values())
        events = churn_and_sample(swarm, args, trainers, url, started)
        monitor = monitor_figures(net, helpers[-1] if len(helpers) > 1 else hosts[0], url, folder / f"scale-{n}.png")
        survivors = [name for name in trainers if name not in events["killed"]]
        for name in survivors:
            if swarm.processes[name].poll() is None:  # one that ended by itself (N = 32: it failed) is gone
                swarm.kill(name, 2)  # SIGINT: Ctrl-C, the survivors leave with a checkpoint
        swarm.wait_for_exit(survivors, 180)
        wire = net.wire_bytes()
    return figures(n, trainers, swarm, events, wire, helpers, monitor)


def figures(
    n: int, trainers: dict, swarm: WanSwarm, events: dict, wire: dict, helpers: list[str], monitor: dict
) -> dict:
    """Figures of one N from what the run printed and counted."""
    killed, logs = events["killed"], swarm.logs
    replaced = {trainers[name]["host"] for name in killed}  # hosts whose wire counts mix two trainers
    survivors = {
        name: survivor_figures(logs[name], None if trainers[name]["host"] in replaced else wire[trainers[name]["host"]])
        for name in trainers
        if name not in killed
    }
    kept = [figures for figures in survivors.values() if figures]
    mean = lambda key: round(statistics.mean(f[key] for f in kept if f[key] is not None)) if kept else None  # noqa: E731
    sampled = events["sampled"].values()
    rounds = round_figures(trainers, logs, killed, len(helpers))
    steps = rounds["global_steps"] or 1
    return {
        "trainers": n,
        "homes": n // 4,
        "helpers": len(helpers),
        **rounds,
        "waiting_seconds_per_step": mean("waiting_seconds_per_step"),
        "averaging_bytes_per_step": mean("averaging_bytes_per_step"),
        "state_bytes_per_step": mean("state_bytes_per_step"),
        "wire_sent_bytes_per_step": mean("wire_sent_bytes_per_step"),
        "helper_wire_sent_bytes_per_step": [wire[host]["sent"] // steps for host in helpers],
        "private_mb": round(statistics.median(s["private"] for s in sampled) / 1e6) if sampled else None,
        "pss_mb": round(statistics.median(s["pss"] for s in sampled) / 1e6) if sampled else None,
        "background_cpu": round(statistics.median(s["cpu_per_second"]["background"] for s in sampled), 3)
        if sampled
        else None,
        "processes": next(iter(sampled))["processes"] if sampled else None,
        "joiners": [joiner_figures(name, launched, logs[name]) for name, launched in events["joined"].items()],
        "killed": len(killed),
        "monitor": monitor,
        "exits": {name: logs[name].returncode for name in trainers if name not in killed},
    }


def show(results: dict[str, dict]) -> None:
    table = Table(title="a crowd on one machine (tiny preset; a quarter of the trainers behind NAT)")
    columns = ("N", "steps", "live share", ">=90%", "step s", "waiting s", "avg KB/step", "wire KB/step",
               "helper KB/step", "private MB", "Pss MB", "bg CPU", "joiner s", "api/state s")  # fmt: skip
    for column in columns:
        table.add_column(column)
    for n, r in results.items():
        joiners = [j["to_first_round"] for j in r["joiners"] if j["to_first_round"] is not None]
        kb = lambda value: "-" if value is None else f"{value / 1e3:,.0f}"  # noqa: E731
        table.add_row(
            n, str(r["global_steps"]), str(r["live_share_median"]), str(r["steps_with_90_percent"]),
            str(r["step_seconds_median"]), str(r["waiting_seconds_per_step"]), kb(r["averaging_bytes_per_step"]),
            kb(r["wire_sent_bytes_per_step"]), " ".join(kb(b) for b in r["helper_wire_sent_bytes_per_step"]),
            str(r["private_mb"]), str(r["pss_mb"]), str(r["background_cpu"]),
            " ".join(f"{s:.0f}" for s in joiners) or "-", str(r["monitor"]["api_state"].get("median")),
        )  # fmt: skip
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32], help="trainers in each run")
    parser.add_argument("--minutes", type=float, default=6.0, help="each run's length after the first trainer starts")
    parser.add_argument("--churn", type=float, default=120.0, help="seconds between a kill (and a new joiner)")
    parser.add_argument("--arrival", type=float, default=3.0, help="seconds between two trainers' arrivals")
    parser.add_argument("--helpers", type=int, default=1, help="public `ttt monitor --assist-averaging` helpers")
    parser.add_argument("--home-rate", default="20mbit", help="the homes' links, both ways (a tc rate)")
    parser.add_argument("--seed", type=int, default=0, help="which trainers are killed")
    parser.add_argument("--logs", default=None, help="folder for every peer's output [default: a temporary one]")
    args = parser.parse_args()
    if (why := can_build()) is not None:
        sys.exit(f"cannot build the NAT testbed: {why}")
    logs = Path(args.logs or tempfile.mkdtemp(prefix="ttt-scale-"))
    args.dataset = make_dataset("tiny", logs / "dataset")
    started, results = time.perf_counter(), {}
    settings = {key: value for key, value in vars(args).items() if key not in ("logs", "dataset", "sizes")}
    for n in args.sizes:
        results[str(n)] = {**one_size(args, n, logs / f"n{n}"), "commit": commit(), "settings": settings}
        console.print(f"N={n}: logs in {logs / f'n{n}'}")
        show(results)
        save_results("scale", results, started, console, keep_other_parts=True)  # each N as soon as it is done


if __name__ == "__main__":
    main()
