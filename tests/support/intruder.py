"""A peer that is not admitted to a run tries what an intruder would: write a metrics record, join an averaging
round with huge gradients, download the model. Run as a process of its own; prints one JSON object with its
peer id and the outcome of each attempt ("refused: ..." or what it got).

    python -m tests.support.intruder --initial-peer MULTIADDR --run-id demo [--token FILE] [--identity KEY]
                                     [--when-told]

Each attempt is a real RPC to the admitted peer at MULTIADDR, through hivemind's own client code:
  metrics         a signed `rpc_store` of a metrics record (the DHT's token protocol answers it)
  join_group      `rpc_join_group` to its gradient averager, as a follower asking to join its group
  aggregate_part  `rpc_aggregate_part` with a part of gradients scaled to 1e6
  download_state  `rpc_download_state` from its state averager
With --token, the intruder presents that token (and signs with --identity's key, or a key of its own). With
--when-told, it starts and then waits for a line on its stdin before it joins (a test starts it early, and tells it
when: starting Python and torch took longer than the run had left on a loaded machine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from functools import partial
from pathlib import Path

import hivemind
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils import get_dht_time
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.multiaddr import Multiaddr

from training.auth.guard import as_proto
from training.auth.identity import load_identity, new_peer_key
from training.auth.tokens import read_token_file
from training.metrics import METRICS_EXPIRATION, PeerMetrics, make_validators, metrics_key
from training.swarm.authorizer import use_as_process_key
from training.swarm.dht import start_node
from training.swarm.optimizer import FailFastStateAverager, SwarmGradientAverager

HUGE = 1e6
INTRUDER_BOOTSTRAP_TRIES = 5  # each takes up to p2pd's bootstrap timeout


class PresentToken(TokenAuthorizerBase):
    """Presents a fixed token (valid or not) and trusts every answer: all an intruder can do."""

    def __init__(self, token: AccessToken, key) -> None:
        super().__init__(key)
        self.token = token

    async def get_token(self) -> AccessToken:
        return self.token

    def is_token_valid(self, access_token: AccessToken) -> bool:
        return True

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        return False


def outcome(error: BaseException | None, answered: str = "") -> str:
    if error is None:
        return f"answered: {answered}"
    return f"refused: {error}" if str(error) else f"refused: {type(error).__name__}"


async def try_metrics(_: hivemind.DHT, node, target: PeerID, run_id: str, public_key: bytes) -> str:
    """Sign a record as DHTNode.store would, and send it straight to the target."""
    metrics = PeerMetrics(
        step=10**6,
        samples_per_second=1e9,
        samples_accumulated=0,
        total_samples=10**9,
        loss=0.0,
        mini_steps=0,
        display_name="intruder",
    )
    protocol = node.protocol
    key_id = DHTID.generate(source=metrics_key(run_id))
    expiration = get_dht_time() + METRICS_EXPIRATION
    record = DHTRecord(
        key_id.to_bytes(), protocol.serializer.dumps(public_key), protocol.serializer.dumps(metrics.dict()), expiration
    )
    value = protocol.record_validator.sign_value(record)
    try:
        stored = await protocol.call_store(target, [key_id], [value], expiration, subkeys=[public_key])
    except Exception as err:  # the p2p layer reports a refusal as an error
        return outcome(err)
    return outcome(None, f"stored {stored}") if stored else outcome(RuntimeError(f"not stored (answer {stored})"))


async def read_stream(stream) -> str:
    """What the target answered: message codes, or how many bytes of state it sent."""
    codes, state_bytes = [], 0
    async for message in stream:
        if isinstance(message, averaging_pb2.DownloadData):
            state_bytes += len(message.tensor_part.buffer) + len(message.metadata)
        elif len(codes) < 3:
            codes.append(averaging_pb2.MessageCode.Name(message.code))
    return f"{state_bytes} bytes of state" if state_bytes else ", ".join(codes) or "nothing"


async def try_averaging(_: hivemind.DHT, node, target: PeerID, run_id: str) -> dict[str, str]:
    p2p = node.p2p
    grad = SwarmGradientAverager.get_stub(p2p, target, namespace=f"{run_id}_grad_averager")
    state = FailFastStateAverager.get_stub(p2p, target, namespace=f"{run_id}_state_averager")
    results = {}
    join = averaging_pb2.JoinRequest(schema_hash=b"intruder", expiration=get_dht_time() + 30, client_mode=False)
    part = averaging_pb2.AveragingData(
        code=averaging_pb2.PART_FOR_AVERAGING,
        group_id=b"intruder",
        tensor_part=serialize_torch_tensor(torch.full((4096,), HUGE)),
        weight=1.0,
    )

    async def parts():
        yield part

    attempts = {
        "join_group": lambda: grad.rpc_join_group(join),
        "aggregate_part": lambda: grad.rpc_aggregate_part(parts()),
        "download_state": lambda: state.rpc_download_state(averaging_pb2.DownloadRequest()),
    }
    for name, call in attempts.items():
        try:
            results[name] = outcome(None, await asyncio.wait_for(read_stream(await call()), timeout=30))
        except Exception as err:
            results[name] = outcome(err)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--initial-peer", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--token", help="a token file to present")
    parser.add_argument("--identity", help="the peer key to sign with [default: a new one]")
    parser.add_argument("--when-told", action="store_true", help="join after a line on stdin, not at once")
    args = parser.parse_args()

    key = load_identity(Path(args.identity)) if args.identity else new_peer_key()
    use_as_process_key(key)
    authorizer = PresentToken(as_proto(read_token_file(Path(args.token)).token), key) if args.token else None
    validators, public_key = make_validators(args.run_id)
    target = PeerID.from_base58(Multiaddr(args.initial_peer).value_for_protocol("p2p"))
    if args.when_told:
        sys.stdin.readline()
    create = partial(
        hivemind.DHT,
        start=True,
        initial_peers=[args.initial_peer],
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        record_validators=validators,
        authorizer=authorizer,
        ensure_bootstrap_success=False,
    )
    # A failed bootstrap is tried again, as ttt's own nodes do (a loaded machine can outlast p2pd's bootstrap), and
    # more often: six intruders start at once beside the trainers (clean-clone run 103: one failed twice).
    dht = start_node(create, partial(print, file=sys.stderr), tries=INTRUDER_BOOTSTRAP_TRIES)
    try:
        metrics = partial(try_metrics, target=target, run_id=args.run_id, public_key=public_key)
        results = {"peer_id": dht.peer_id.to_base58(), "metrics": dht.run_coroutine(metrics)}
        results.update(dht.run_coroutine(partial(try_averaging, target=target, run_id=args.run_id)))
    finally:
        dht.shutdown()
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
