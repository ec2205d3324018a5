"""Benchmark of authentication (ttt auth) on this machine, all in one run.

1. per-request cost: the auth server signing a token, a peer checking one (the authority's RSA signature), a
   DHT request signed and checked by hivemind's token protocol, and the averaging check of a caller whose
   credential is already read; and the auth server's whole POST /api/token (scrypt password check included);
2. a training step with and without authentication: two `ttt train` peers of the tiny preset on the embedded
   sample on 127.0.0.1, an open run and a run whose peers hold tokens from a local auth server (renewed every
   30 s, so renewals happen during the measurement), the same steps; seconds per global step after the first
   few, and their ratio.

Prints tables and writes every figure to bench/results/auth.json.

    .venv/bin/python -m bench.auth [--steps 24] [--only requests,steps]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import statistics
import tempfile
import threading
import time
from pathlib import Path

from hivemind.proto import dht_pb2
from rich.console import Console
from rich.table import Table

from bench.common import save_results, timed
from tests.support.datasets import write_sample
from tests.support.swarm_runs import SwarmRun, start_auth_server
from training.auth.client import Login, request_token
from training.auth.guard import AccessState, AdmittedPeers, TokenAuthorizer, as_proto
from training.auth.identity import new_peer_key, peer_id_of
from training.auth.keys import create_authority, load_authority
from training.auth.server import AuthService, start_server
from training.auth.tokens import issue_token, token_refusal
from training.auth.users import hash_password, write_allowlist
from training.config import AuthServerSettings

console = Console(width=130)
WARM_UP_STEPS = 4  # global steps before the timed ones: state download, first rounds, optimizer state


def per_second(work, seconds: float = 2.0) -> float:
    """Seconds per call of `work`."""
    runs, elapsed = timed(work, seconds)
    return elapsed / runs


def per_call(make_coroutine, calls: int = 500) -> float:
    """Seconds per call of an async piece of work, all calls in one event loop."""

    async def run() -> float:
        await make_coroutine()  # warm up
        started = time.perf_counter()
        for _ in range(calls):
            await make_coroutine()
        return (time.perf_counter() - started) / calls

    return asyncio.run(run())


def bench_requests() -> dict:
    """Seconds per operation of each piece of the protocol."""
    with tempfile.TemporaryDirectory(prefix="ttt-bench-auth-") as tmp:
        authority = create_authority(Path(tmp) / "authority", "bench")
        peer_key, caller_key = new_peer_key(), new_peer_key()
        caller_public = caller_key.get_public_key().to_bytes()
        token = issue_token(authority, "alice", caller_public)
        costs = {
            "issue a token (authority signs)": per_second(lambda: issue_token(authority, "alice", caller_public)),
            "check a token (signature, expiry, revocations)": per_second(
                lambda: token_refusal(token, authority.public, {})
            ),
        }

        state = AccessState("bench", authority.public)
        state.own_token.write(as_proto(token).SerializeToString())
        client, service = TokenAuthorizer(state, caller_key), TokenAuthorizer(state, peer_key)
        request = dht_pb2.PingRequest(peer=dht_pb2.NodeInfo(node_id=b"x" * 20), validate=True)

        async def sign_and_check() -> None:
            signed = dht_pb2.PingRequest()
            signed.CopyFrom(request)
            await client.sign_request(signed, None)
            assert await service.validate_request(signed)

        admitted = AdmittedPeers(state)
        caller = peer_id_of(caller_public)
        admitted.tokens[caller] = as_proto(token)
        costs["DHT request: sign + check (hivemind's token protocol)"] = per_call(sign_and_check)
        costs["averaging request: check the caller's credential"] = per_call(
            lambda: admitted.check(caller, "join_group", None)
        )

        folder = authority.folder
        allowlist = Path(tmp) / "users.toml"
        write_allowlist(allowlist, {"alice": hash_password("alice-secret-1")})
        settings = AuthServerSettings(authority=str(folder), allowlist=str(allowlist), host="127.0.0.1", port=0)
        server = start_server(AuthService(load_authority(folder), settings), settings)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}"
        login = Login("alice", "alice-secret-1")
        with contextlib.redirect_stdout(io.StringIO()):  # the server's request log
            costs["auth server: POST /api/token (scrypt + signature + HTTP)"] = per_second(
                lambda: request_token(url, "bench", caller_public, login)
            )
        server.shutdown()
        server.server_close()
    return costs


def bench_steps(steps: int) -> dict:
    """Seconds per global step of two peers, open and authenticated, after WARM_UP_STEPS."""
    results = {}
    with tempfile.TemporaryDirectory(prefix="ttt-bench-auth-steps-") as tmp:
        tmp = Path(tmp)
        dataset = tmp / "sample"
        write_sample(dataset, 1200)
        authority = create_authority(tmp / "authority", "bench")
        allowlist = tmp / "users.toml"
        write_allowlist(allowlist, {name: hash_password(f"{name}-secret-1") for name in ("a", "b")})
        server, url = start_auth_server(
            authority.folder, ["--allowlist", str(allowlist), "--token-lifetime", "30"], tmp / "server.log"
        )
        common = [
            "--dataset",
            str(dataset),
            "--run-id",
            "bench",
            "--max-steps",
            str(WARM_UP_STEPS + steps),
            "--threads",
            "1",
            "--loader-workers",
            "0",
            "--host-maddrs",
            "/ip4/127.0.0.1/tcp/0",
        ]
        auth = [
            "--authority-key",
            str(authority.folder / "run.pub"),
            "--auth-server",
            url,
            "--auth-refresh",
            "5",
        ]
        try:
            for name, extra in (("open", []), ("authenticated", auth)):
                console.print(f"  two peers, {name} run, {WARM_UP_STEPS + steps} global steps")
                results[name] = swarm_step_seconds(SwarmRun(tmp / name, [*common, *extra]), bool(extra))
        finally:
            server.terminate()
            server.wait(timeout=30)
    results["ratio"] = results["authenticated"]["seconds_per_step"] / results["open"]["seconds_per_step"]
    return results


def swarm_step_seconds(run: SwarmRun, authenticated: bool) -> dict:
    for name in ("a", "b"):
        extra = ["--username", name] if authenticated else []
        run.start(
            name, *extra, *(["--wait-for-peers", "2"] if name == "a" else []), env={"TTT_PASSWORD": f"{name}-secret-1"}
        )
    logs = run.finish()
    times = [seen for step, _, seen in logs["a"].rounds if step > WARM_UP_STEPS]
    together = sum(size >= 2 for step, size, _ in logs["a"].rounds if step > WARM_UP_STEPS)
    gaps = [later - earlier for earlier, later in zip(times, times[1:], strict=False)]
    return {
        "seconds_per_step": statistics.mean(gaps),
        "rounds_together": together,
        "timed_steps": len(times),
        "renewals": logs["a"].text.count("access token renewed"),
    }


def print_results(results: dict) -> None:
    if "requests" in results:
        table = Table(title="the cost of each check")
        table.add_column("operation")
        table.add_column("time", justify="right")
        for operation, seconds in results["requests"].items():
            table.add_row(operation, f"{seconds * 1e3:.3f} ms")
        console.print(table)
    if "steps" in results:
        steps = results["steps"]
        table = Table(title="two peers of the tiny preset on 127.0.0.1: a global step")
        for column in ("run", "seconds per step", "rounds of 2", "token renewals"):
            table.add_column(column, justify="right")
        for name in ("open", "authenticated"):
            row = steps[name]
            table.add_row(
                name,
                f"{row['seconds_per_step']:.2f}",
                f"{row['rounds_together']}/{row['timed_steps']}",
                str(row["renewals"]),
            )
        console.print(table)
        console.print(f"authenticated / open step time: [bold]{steps['ratio']:.3f}[/]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=24, help="timed global steps per run")
    parser.add_argument("--only", default="requests,steps", help="the parts to run, comma-separated")
    args = parser.parse_args()
    parts = set(args.only.split(","))
    started = time.perf_counter()
    results = {}
    if "requests" in parts:
        results["requests"] = bench_requests()
    if "steps" in parts:
        results["steps"] = bench_steps(args.steps)
    print_results(results)
    save_results("auth", results, started, console, keep_other_parts=True)


if __name__ == "__main__":
    main()
