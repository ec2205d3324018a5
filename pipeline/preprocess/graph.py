"""The Dask graph: one task chain per shard, download -> encode -> serialize, on any cluster.

By default a `LocalCluster` sized to the machine: one worker process per core, each with two
threads and one `compute` slot. Encode and serialize tasks take the compute slot, so a worker
encodes one shard at a time while its other thread downloads another shard: downloads mostly
wait on image hosts, and the wait overlaps the encoding instead of idling the core. Dask queues
the download tasks of a large run on the scheduler and hands a worker a new one only as its
tasks finish, so a worker never downloads far ahead of its encoder.

`--scheduler ADDRESS` uses an existing `dask.distributed` cluster instead. When workers
advertise a `GPU` resource (`dask worker --resources GPU=1`), encode tasks ask for it, so
encoding lands on GPU workers while downloads run anywhere; workers started with
`--nthreads 2 --resources compute=1` overlap downloads and encoding as the LocalCluster's do.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import dask
import pandas as pd
from distributed import Client, Future, LocalCluster, as_completed

from pipeline.preprocess.download import DownloadSettings, download_shard, resize_local_images
from pipeline.preprocess.encode import EncodeSettings, encode_shard
from pipeline.preprocess.writer import ShardBlob, WriteSettings, serialize_shard
from pipeline.vqgan.codec import VQGANSpec

# The resource that encode and serialize tasks take: one per LocalCluster worker, whose second thread downloads.
COMPUTE_SLOT = "compute"
THREADS_PER_WORKER = 2
# How long a run on an existing cluster waits for its first worker before it says the cluster has none.
WORKER_WAIT_SECONDS = 60.0
# distributed's event loop reports the exceptions of its callbacks (tornado's logger) and of its tasks nobody awaited
# any more (asyncio's) on the console. On Ctrl-C its own failed there, beside "interrupted: ... re-run the same command
# to resume": `sync()`'s cancel, reached before its future existed (a NameError); a `future.result()` left by the
# interrupt, whose gather task then found its futures released (`AllExit`, in the CI of stop 68). Dask's internals, not
# the user's: a preprocess run's only event loop is Dask's.
EVENT_LOOP_LOGGERS = ("tornado.application", "asyncio")


@dataclass(frozen=True)
class ShardJob:
    index: int
    rows: pd.DataFrame  # the shard's rows after filtering, in plan order


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@contextmanager
def dask_client(scheduler: str | None, workers: int | None = None) -> Iterator[Client]:
    """Connect to `scheduler`, or start a LocalCluster with one worker per core (two threads, one compute slot)."""
    for name in EVENT_LOOP_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    if scheduler:
        try:
            client = Client(scheduler, timeout="20s")
        except OSError as err:
            raise ConnectionError(f"cannot reach the Dask scheduler at {scheduler}: {err}") from None
        with client:
            wait_for_a_worker(client, scheduler)
            yield client
        return
    # Worker processes inherit an ignored SIGINT, so Ctrl-C reaches only the driver, which then
    # shuts the cluster down in order instead of every worker dying with a traceback.
    previous_handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Dask's default MALLOC_TRIM_THRESHOLD_ for workers makes glibc return every batch's tensors to the
    # OS and map them again: it halves the sample VQGAN's encode speed (bench/preprocess.py).
    no_trim = {"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None}
    try:
        with dask.config.set(no_trim):
            cluster = LocalCluster(
                n_workers=workers or available_cores(),
                threads_per_worker=THREADS_PER_WORKER,
                resources={COMPUTE_SLOT: 1},
                processes=True,
                silence_logs=logging.ERROR,
                dashboard_address=":8787",
            )
    finally:
        signal.signal(signal.SIGINT, previous_handler)
    with cluster, Client(cluster) as client:
        yield client


def wait_for_a_worker(client: Client, scheduler: str) -> None:
    """Return once the cluster has a worker; a scheduler without any would hold the run's tasks forever."""
    try:
        client.wait_for_workers(1, timeout=WORKER_WAIT_SECONDS)
    except TimeoutError:
        raise ConnectionError(
            f"the Dask scheduler at {scheduler} has no workers after {WORKER_WAIT_SECONDS:.0f} s; "
            f"start some with `dask worker {scheduler}`"
        ) from None


def _load_images_task(index: int, rows: pd.DataFrame, settings: DownloadSettings):
    """--from-images: read the already-downloaded images, then resize them like a download would."""
    from pipeline.preprocess.img2dataset_output import load_images

    return resize_local_images(rows, load_images(rows["source"].tolist()), settings)


def submit_shards(
    client: Client,
    jobs: list[ShardJob],
    download: DownloadSettings,
    encode: EncodeSettings,
    write: WriteSettings,
    spec: VQGANSpec,
    from_images: bool,
    run_token: str,
) -> dict[Future, int]:
    """Submit every shard's chain; returns the futures of the serialized shards, with their shard index."""
    advertised = {name for w in client.scheduler_info()["workers"].values() for name in w.get("resources", {})}
    compute = {COMPUTE_SLOT: 1} if COMPUTE_SLOT in advertised else None
    encode_resources = {"GPU": 1} if "GPU" in advertised else compute
    load = _load_images_task if from_images else download_shard
    futures = {}
    for position, job in enumerate(jobs):
        tag = f"{job.index:05d}-{run_token}"
        # Earlier shards first; an encoded shard's serialize before any other encode, so it leaves the worker.
        first_come = -position
        # Downloads ask for no resource: Dask queues them on the scheduler (root tasks), which bounds
        # how many shards' images a worker holds.
        images = client.submit(
            load, job.index, job.rows, download, key=f"download-{tag}", retries=1, priority=first_come
        )
        codes = client.submit(
            encode_shard, images, spec, encode, key=f"encode-{tag}", resources=encode_resources, priority=first_come
        )
        blob = client.submit(
            serialize_shard,
            codes,
            write,
            job.index,
            len(job.rows),
            key=f"serialize-{tag}",
            resources=compute,
            priority=first_come + len(jobs),
        )
        futures[blob] = job.index
    return futures


def gather_as_completed(futures: dict[Future, int], on_blob: Callable[[ShardBlob], None]) -> dict[int, str]:
    """Hand each finished shard to `on_blob` as soon as it is ready; returns the failed shards' errors.

    A shard whose chain fails (after Dask's retry) does not stop the others: they are all written,
    and a re-run retries only what is missing.
    """
    failed = {}
    for future in as_completed(list(futures)):
        try:
            blob = future.result()
        except Exception as err:  # whatever the task raised on its worker
            failed[futures[future]] = f"{type(err).__name__}: {err}"
            continue
        finally:
            future.release()
        on_blob(blob)
    return failed


STALL_SECONDS = 240.0  # without a finished shard for this long (or 5x the slowest shard so far), ttt says why


class StallReport:
    """Says once, when no shard has finished for a while, what each worker is running (Dask's `call_stack`), so that
    a run that hangs shows where. A shard that finishes lets it say so again at the next stall."""

    def __init__(self, client: Client, say: Callable[[str], object], check_every: float = 5.0) -> None:
        self.client, self.say, self.check_every = client, say, check_every
        self.last = time.monotonic()
        self.slowest = 0.0
        self.reported = False
        self.done = threading.Event()

    def __enter__(self) -> StallReport:
        threading.Thread(target=self.watch, daemon=True, name="ttt-stall-report").start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()

    def shard_done(self) -> None:
        now = time.monotonic()
        self.slowest, self.last, self.reported = max(self.slowest, now - self.last), now, False

    def watch(self) -> None:
        while not self.done.wait(self.check_every):
            waited = time.monotonic() - self.last
            if self.reported or waited < max(STALL_SECONDS, 5 * self.slowest):
                continue
            self.reported = True
            try:
                stacks = self.client.call_stack()
            except Exception as err:  # the report must never break the run it reports on
                stacks = {"(unavailable)": {type(err).__name__: [str(err)]}}
            lines = [f"no shard finished in the last {waited:.0f} s; what the workers are running:"]
            for worker, tasks in stacks.items():
                lines.append(f"  {worker}: {', '.join(tasks) or 'nothing'}")
                lines += [f"    {frame.strip()}" for frames in tasks.values() for frame in frames[-8:]]
            self.say("\n".join(lines))
