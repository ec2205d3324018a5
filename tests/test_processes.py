"""hivemind's processes as training/swarm/processes.py makes them behave: a library destructor's error at exit goes to
hivemind's log, the threads of a forked process run torch's parallel operations at once, and every process gives
its freed heap back; and a peer whose optimizer fails to start still exits."""

import multiprocessing
import os
import subprocess
import sys
import threading

import torch

from training.swarm.processes import quiet_hivemind_children

THREADS = 8
FORKS = 30


def test_a_hivemind_destructor_failing_at_exit_writes_to_hivemind_log_not_the_console(tmp_path):
    """hivemind's MPFuture, collected at exit after its event loop closed, raised in its destructor, and Python
    printed the traceback into a leaving peer's console (seen in test_auth: carol's goodbye ended in one)."""
    script = f"""
from pathlib import Path
from training.swarm.processes import log_hivemind_to

log_hivemind_to(Path({str(tmp_path / "hivemind.log")!r}))

class Future:
    def __del__(self):
        raise RuntimeError("Event loop is closed")

Future.__module__ = Future.__del__.__module__ = "hivemind.utils.mpfuture"

class Mine:
    def __del__(self):
        raise RuntimeError("ttt's own")

Future(), Mine()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert "Event loop is closed" not in done.stderr and "ttt's own" in done.stderr, done.stderr
    assert "ignored in Future.__del__: RuntimeError: Event loop is closed" in (tmp_path / "hivemind.log").read_text()


def test_a_peer_whose_optimizer_fails_to_start_exits(tmp_path):
    """hivemind's optimizer starts its progress tracker before its averagers: when making them failed (`ttt train
    --local-steps 4 --outer-momentum 0` did), the tracker's pending DHT request kept the process alive after its
    error, for good. SwarmOptimizer stops what hivemind had started."""
    script = f"""
import hivemind, torch
from pathlib import Path
from training.swarm.optimizer import SwarmOptimizer
from training.swarm.processes import log_hivemind_to, quiet_hivemind_children

def failing(params):
    raise ValueError("this optimizer cannot start")

log_hivemind_to(Path({str(tmp_path / "hivemind.log")!r}))
with quiet_hivemind_children():
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        SwarmOptimizer(dht=dht, run_id="broken", params=torch.nn.Linear(4, 4).parameters(), optimizer=failing,
                       target_batch_size=64, batch_size_per_step=16)
    except ValueError as error:
        print("refused:", error)
dht.shutdown()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "refused: this optimizer cannot start" in done.stdout, done.stderr


def parallel_operations_at_once(errors: multiprocessing.Queue) -> None:
    """In a forked process: THREADS threads each run their first parallel operation at the same moment."""
    start, failed = threading.Barrier(THREADS), []

    def operate() -> None:
        start.wait()
        try:
            (torch.ones(200_000) * 2).sum()
        except RuntimeError as err:
            failed.append(str(err))

    threads = [threading.Thread(target=operate) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    errors.put(failed)


def test_the_threads_of_a_forked_process_run_torch_operations_at_once():
    """hivemind's averager reduces several senders' parts in threads at once. Without the pool renewed at the fork,
    25 of 30 forks had a thread fail with torch's "Invalid thread pool!" (a DiLoCo round failed for all its peers)."""
    torch.set_num_threads(torch.get_num_threads())  # as `ttt train --threads` does, before hivemind forks
    torch.ones(1000, 1000).sum()
    fork = multiprocessing.get_context("fork")
    failures = []
    with quiet_hivemind_children():
        for _ in range(FORKS):
            errors = fork.Queue()
            child = fork.Process(target=parallel_operations_at_once, args=(errors,))
            child.start()
            failures += errors.get(timeout=60)
            child.join()
    assert failures == []


def test_tensors_cross_to_hivemind_processes_as_descriptors_without_torch_shm_manager():
    """hivemind sets torch's `file_system` strategy as it is imported: its averager's tensors then went through a
    torch_shm_manager process of each peer (51-56 MB private) and files in /dev/shm that a killed peer leaves behind.
    Within quiet_hivemind_children they cross as file descriptors: no manager, no file, and the soft limit on open
    files is the hard one (each shared tensor holds a descriptor in each process)."""
    script = """
import os, resource
import hivemind, torch
from pathlib import Path
from training.swarm.processes import descendants_of, quiet_hivemind_children

with quiet_hivemind_children():
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    averager = hivemind.averaging.DecentralizedAverager([torch.zeros(1000)], dht, prefix="shared", start=True)
names = [Path(f"/proc/{pid}/comm").read_text().strip() for pid in descendants_of(os.getpid())]
mine = [f for f in os.listdir("/dev/shm") if f.startswith(tuple(f"torch_{p}_" for p in [os.getpid(), averager.pid]))]
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
print(torch.multiprocessing.get_sharing_strategy(), sorted(set(names)), mine, soft == hard)
averager.shutdown(), dht.shutdown()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "file_descriptor ['p2pd', 'python'] [] True", done.stdout


HEAP_SCRIPT = """
import gc, multiprocessing, os, subprocess, sys, time
from training.swarm.processes import quiet_hivemind_children

HOG = "import time\\nuntil = time.monotonic() + 20\\nwhile time.monotonic() < until: pass"

def private_mb():
    rollup = open("/proc/self/smaps_rollup").read().splitlines()
    values = {line.split(":")[0]: int(line.split()[1]) for line in rollup[1:]}
    return (values["Private_Clean"] + values["Private_Dirty"]) / 1024

def freed_but_held(results, busy=False):
    hogs = []
    if busy:  # beside two other processes on one core: it runs a third of the time, and is ready to run the rest
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(2)]
    blocks = [bytearray(60_000) for _ in range(4000)]  # 240 MB of blocks under glibc's mapping threshold: its heap
    del blocks[::2]  # 120 MB freed in holes between the others, which no free() can give back
    before, until = private_mb(), time.monotonic() + 1.0
    while time.monotonic() < until:  # computing the while (a peer's steps), or waiting
        if busy:
            sum(range(1000))
        else:
            time.sleep(0.05)
    results.put(round(before - private_mb()))
    for hog in hogs:
        hog.kill()

fork = multiprocessing.get_context("fork")
results = fork.Queue()
with quiet_hivemind_children():
    child = fork.Process(target=freed_but_held, args=(results,))
    child.start()
    child.join()
    freed_but_held(results)
    busy = fork.Process(target=freed_but_held, args=(results, True))
    busy.start()
    busy.join()
print(results.get(), results.get(), results.get(), gc.get_freeze_count() > 0)
"""


def test_a_peers_processes_give_their_freed_heap_back_and_fork_from_frozen_objects():
    """glibc keeps a heap's freed pages for the next blocks: most of a tiny trainer's heap was freed memory held so.
    Within quiet_hivemind_children the main process and every process forked from it trim their heap now and then
    (here every 0.2 s) when they mostly waited, and the objects there are before a fork are frozen (gc.freeze);
    undone (bench.memory's baseline), the same 120 MB stay held. A process that computes meanwhile keeps them: it
    would fault them back in at once (about a fifth of a compute-bound peer's speed). Here it computes beside two
    other processes on one core: it runs a third of the time and waits for the core the rest, busy all the same
    (a swarm test on the other pytest worker starved it so in clean-clone run 216)."""
    runs = {}
    for period, freeze in (("0.2", "1"), ("0", "0")):
        env = {**os.environ, "TTT_HEAP_TRIM_SECONDS": period, "TTT_GC_FREEZE": freeze}
        done = subprocess.run([sys.executable, "-c", HEAP_SCRIPT], capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 0, done.stderr
        child, main, busy, frozen = done.stdout.split()
        runs[period] = (int(child), int(main), int(busy), frozen)
    assert runs["0.2"][0] > 80 and runs["0.2"][1] > 80 and runs["0.2"][2] < 20 and runs["0.2"][3] == "True", runs
    assert runs["0"][0] < 20 and runs["0"][1] < 20 and runs["0"][2] < 20 and runs["0"][3] == "False", runs
