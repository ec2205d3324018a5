"""Benchmark of `ttt monitor` on this machine: does it keep up with a run of hundreds of peers?

1. one refresh (read every signed record from the DHT, summarize, one SQLite transaction, build the JSON and
   the Prometheus text) and one `GET /api/state` from the live server, with 10, 100 and 1,000 peers' signed
   records (real 2048-bit RSA keys, published through a second DHT as that many peers would), against the
   refresh period (10 s by default);
2. the same with a long history behind it: 50,000 refreshes (six days at 10 s) already in the database;
3. the monitor's memory: the proportional set size of this process (which has torch loaded, as `ttt monitor`
   has) and its DHT process, without a model (--checkpoint-every 0);
4. the dashboard page: the bytes it loads (page, scripts, styles, chart library, a state) and the time
   headless Chromium takes from navigation to drawn charts.

Prints a table and writes every figure to bench/results/monitor.json.

    .venv/bin/python -m bench.monitor [--peers 10,100,1000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import io
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
from rich.console import Console
from rich.table import Table

from bench.common import median_seconds, save_results
from tests.support.synthetic_peers import SyntheticPeers, make_keys
from training.config import MonitorSettings, RunSettings
from training.metrics import PeerMetrics
from training.monitor.run import Monitor
from training.monitor.server import STATIC

LONG_HISTORY = 50_000


def peer_records(count: int) -> list[PeerMetrics]:
    return [
        PeerMetrics(
            step=1000,
            samples_per_second=12.5,
            samples_accumulated=48,
            total_samples=48_000 + index,
            loss=4.2,
            mini_steps=3,
            display_name=f"volunteer-{index}",
            parameters_hash="0123456789abcdef",
        )
        for index in range(count)
    ]


def fill_history(monitor: Monitor, rows: int) -> None:
    """ROWS past refreshes, one every 10 s, before the monitor's own."""
    now = time.time()
    with monitor.history.db:
        monitor.history.db.executemany(
            "INSERT INTO series VALUES (?, ?, ?, ?, ?, ?, 0)",
            [(now - 10 * (rows - i), i // 6, 4.2, 500.0, 40, i * 3000) for i in range(rows)],
        )


def measure(count: int, keys: list, repeats: int, long_history: bool, folder: Path) -> dict:
    run_id = f"bench-{count}{'-long' if long_history else ''}"
    settings = MonitorSettings(
        run=RunSettings(run_id=run_id),
        port=0,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        checkpoint_dir=str(folder / run_id),
        checkpoint_every=0,
    )
    monitor = Monitor(settings, Console(file=io.StringIO()))
    peers = SyntheticPeers(run_id, keys[:count], monitor.dht.get_visible_maddrs())
    try:
        if long_history:
            fill_history(monitor, LONG_HISTORY)
        peers.publish(peer_records(count))
        state = monitor.refresh()
        if state.summary.active_peers != count:
            raise RuntimeError(f"the monitor saw {state.summary.active_peers} of {count} peers")
        refresh_ms = median_seconds(monitor.refresh, repeats) * 1000
        url = f"http://127.0.0.1:{monitor.server.server_address[1]}/api/state"
        body = urllib.request.urlopen(url).read()
        api_ms = median_seconds(lambda: urllib.request.urlopen(url).read(), repeats * 10) * 1000
        # PSS: the DHT process is forked from this one, so RSS would count the pages they share twice.
        process = psutil.Process()
        processes = [process, *process.children(recursive=True)]
        pss = sum(each.memory_full_info().pss for each in processes)
        return {"refresh_ms": refresh_ms, "api_state_ms": api_ms, "state_bytes": len(body), "pss_bytes": pss}
    finally:
        peers.shutdown()
        monitor.shutdown()


def dashboard_figures(folder: Path) -> dict:
    """Bytes the dashboard loads and the time Chromium takes to draw it, against a monitor with 100 peers."""
    from tests.support.browser import open_dashboard

    keys = make_keys(100)
    settings = MonitorSettings(
        run=RunSettings(run_id="bench-page"),
        port=0,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        checkpoint_dir=str(folder / "page"),
    )
    monitor = Monitor(settings, Console(file=io.StringIO()))
    peers = SyntheticPeers("bench-page", keys, monitor.dht.get_visible_maddrs())
    try:
        peers.publish(peer_records(100))
        monitor.refresh()
        url = f"http://127.0.0.1:{monitor.server.server_address[1]}/"
        assets = sum(path.stat().st_size for path in STATIC.rglob("*") if path.is_file() and "join" not in path.name)
        state_bytes = len(urllib.request.urlopen(url + "api/state").read())
        started = time.perf_counter()
        report = open_dashboard(url, folder / "dashboard.png")
        seconds = time.perf_counter() - started
        if report["errors"]:
            raise RuntimeError(f"the dashboard loaded with errors: {report['errors']}")
        return {"page_bytes": assets + state_bytes, "browser_load_seconds": seconds}
    finally:
        peers.shutdown()
        monitor.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", default="10,100,1000")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    counts = [int(count) for count in args.peers.split(",")]
    console = Console()
    started = time.perf_counter()
    console.print(f"making {max(counts)} RSA keys (2048 bits, as peers use)")
    keys = make_keys(max(counts))
    results: dict = {"refresh_period_s": MonitorSettings().refresh}
    table = Table(title="ttt monitor: one refresh and one /api/state (median)")
    for column in ("peers", "history", "refresh", "of the 10 s period", "/api/state", "state JSON", "memory (PSS)"):
        table.add_column(column, justify="right")
    with tempfile.TemporaryDirectory() as tmp:
        for count in counts:
            for long_history in (False, True):
                figures = measure(count, keys, args.repeats, long_history, Path(tmp))
                history = f"{LONG_HISTORY:,} refreshes" if long_history else "fresh"
                results[f"{count}_peers{'_long_history' if long_history else ''}"] = figures
                table.add_row(
                    f"{count:,}",
                    history,
                    f"{figures['refresh_ms']:.1f} ms",
                    f"{figures['refresh_ms'] / 1000 / results['refresh_period_s']:.2%}",
                    f"{figures['api_state_ms']:.2f} ms",
                    f"{figures['state_bytes'] / 1024:,.0f} KiB",
                    f"{figures['pss_bytes'] / 2**20:,.0f} MiB",
                )
        console.print(table)
        page = dashboard_figures(Path(tmp))
    results["dashboard"] = page
    console.print(
        f"dashboard: {page['page_bytes'] / 1024:,.0f} KiB loaded (page, scripts, styles, uPlot, a 100-peer state); "
        f"headless Chromium draws it in {page['browser_load_seconds']:.2f} s (browser start included)"
    )
    save_results("monitor", results, started, console)


if __name__ == "__main__":
    main()
