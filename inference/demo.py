"""`ttt demo`: the whole loop on the embedded sample, offline, in about 8 minutes on 2 CPU cores.

1. preprocess   the embedded sample -> ./ttt-data (the same run as `ttt preprocess`; resumes if done)
2. train        the tiny preset with two local hivemind peers (`ttt train --stream` processes
                on 127.0.0.1, the second joining through the first's address) -> ./ckpt
3. generate     images (top-p 0.75) for two prompts the model saw and two it never saw -> ./samples, then the
                share of images the sample judge accepts over all 16 seen prompts and all 16 held-out
                compositions, each with a 95% confidence interval
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from inference.generate import generate
from inference.sample_quality import HELDOUT_PROMPTS, SEEN_PROMPTS, Acceptance, judge_sample_prompts
from inference.settings import DemoSettings, GenerateSettings
from pipeline.core.console import ttt_console
from pipeline.core.errors import UserError
from pipeline.sample.tokenizer import TOKENIZER_PATH
from training.checkpoint import LATEST, latest_checkpoint, read_config

DEMO_RUN_ID = "ttt-demo"
DEMO_PROMPTS = (SEEN_PROMPTS[0], SEEN_PROMPTS[4], HELDOUT_PROMPTS[0], HELDOUT_PROMPTS[3])
ADDRESS = re.compile(r"^/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+$")
STEP_LINE = re.compile(r"^step\s+\d+ \|")
ADDRESS_TIMEOUT = 120.0  # seconds the first peer gets to start its DHT and print its address
PEER_EXIT_GRACE = 60.0  # seconds a peer gets to save and leave after Ctrl-C


class DemoError(UserError):
    pass


def check_checkpoint_dir(folder: Path) -> None:
    """Never overwrite the checkpoints of a real run: only an empty folder or an earlier demo's."""
    if not (folder / LATEST).is_file():
        return
    run_id = read_config(latest_checkpoint(folder)).get("run_id")
    if run_id != DEMO_RUN_ID:
        raise DemoError(f"{folder} holds checkpoints of run {run_id!r}; pass another --checkpoint-dir for the demo")


class LocalPeer:
    """One `ttt train --stream` process whose output is echoed with a prefix (and kept to find its address).

    With `echo_steps` False its per-step progress lines are kept but not shown (one peer's are enough).
    """

    def __init__(self, name: str, command: list[str], console: Console, echo_steps: bool = True) -> None:
        self.name, self.console, self.lines, self.echo_steps = name, console, [], echo_steps
        self.address_found = threading.Event()
        self.address: str | None = None
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.reader = threading.Thread(target=self._echo, daemon=True)
        self.reader.start()

    def _echo(self) -> None:
        for line in self.process.stdout:
            line = line.rstrip()
            self.lines.append(line)
            if self.address is None and ADDRESS.match(line):
                self.address = line
                self.address_found.set()
            if self.echo_steps or not STEP_LINE.match(line):
                self.console.print(f"[dim]\\[{self.name}][/dim] {escape(line)}", highlight=False)
        self.address_found.set()  # the process ended: stop waiting for an address

    def wait(self) -> None:
        code = self.process.wait()
        self.reader.join()
        if code == 130:  # the peer was interrupted (Ctrl-C reaches every process of the terminal's group)
            raise KeyboardInterrupt
        if code != 0:
            last = self.lines[-1] if self.lines else "no output"
            raise DemoError(f"{self.name} exited with code {code}: {last}")


def peer_command(settings: DemoSettings, name: str, checkpoint_dir: str, initial_peers: list[str]) -> list[str]:
    command = [sys.executable, "-m", "cli", "train", "--stream", "--dataset", settings.dataset]
    threads = max(1, (os.cpu_count() or 1) // settings.peers)  # the peers share this machine's cores
    command += ["--run-id", DEMO_RUN_ID, "--preset", "tiny", "--name", name, "--threads", str(threads)]
    command += ["--tokenizer", str(TOKENIZER_PATH)]  # a token per word of the sample's captions
    command += ["--max-steps", str(settings.steps), "--total-steps", str(settings.steps)]
    command += ["--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--checkpoint-dir", checkpoint_dir]
    # On one machine a group assembles at once: a short matchmaking time keeps the peers busy training.
    command += ["--checkpoint-every", str(settings.steps), "--matchmaking-time", "0.5", "--seed", str(settings.seed)]
    for address in initial_peers:
        command += ["--initial-peers", address]
    if not initial_peers:  # the first peer waits for the others: all of them train every step
        command += ["--wait-for-peers", str(settings.peers)]
    return command


def train_local_swarm(settings: DemoSettings, console: Console) -> None:
    """Start the first peer, then the others with its address; wait until all finish the run."""
    first = LocalPeer("peer 1", peer_command(settings, "demo-peer-1", settings.checkpoint_dir, []), console)
    peers = [first]
    try:
        first.address_found.wait(timeout=ADDRESS_TIMEOUT)
        if first.address is None:
            if first.process.poll() is not None:
                first.wait()  # it failed: raises with its last line
            raise DemoError(f"the first peer printed no address to join within {ADDRESS_TIMEOUT:.0f} s")
        for index in range(2, settings.peers + 1):
            folder = str(Path(settings.checkpoint_dir) / "other-peers" / f"peer-{index}")
            command = peer_command(settings, f"demo-peer-{index}", folder, [first.address])
            peers.append(LocalPeer(f"peer {index}", command, console, echo_steps=False))
        for peer in peers:
            peer.wait()
    except KeyboardInterrupt:  # the peers got the Ctrl-C too: let them save a checkpoint and leave
        for peer in peers:
            try:
                peer.process.wait(timeout=PEER_EXIT_GRACE)
            except subprocess.TimeoutExpired:
                pass
        raise
    finally:
        for peer in peers:  # after an error: no peer outlives the demo
            if peer.process.poll() is None:
                peer.process.terminate()
                peer.process.wait()


def run_demo(settings: DemoSettings, console: Console | None = None) -> dict[str, Acceptance]:
    """Preprocess, train, generate; returns what the judge accepted of the seen and the held-out prompts."""
    from pipeline.preprocess.options import PreprocessOptions
    from pipeline.preprocess.run import preprocess

    console = console or ttt_console()
    if settings.peers < 1 or settings.steps < 1:
        raise DemoError("--peers and --steps must be at least 1")
    check_checkpoint_dir(Path(settings.checkpoint_dir))
    console.rule("1/3  ttt preprocess: the embedded sample -> VQGAN codes")
    preprocess(
        PreprocessOptions(output=settings.dataset, sample_port=settings.sample_port, command="ttt demo"), console
    )
    console.rule(f"2/3  ttt train --stream: the tiny preset, {settings.peers} local peers, {settings.steps} steps")
    train_local_swarm(settings, console)
    console.rule("3/3  ttt generate: prompts the model saw, and compositions it never saw")
    drawn = {}
    for prompt in DEMO_PROMPTS:
        generating = GenerateSettings(
            prompt,
            checkpoint=settings.checkpoint_dir,
            out=settings.out,
            num_samples=settings.samples_per_prompt,
            seed=settings.seed,
        )
        result = generate(generating, Console(quiet=True))
        drawn[prompt] = sum(result.judged)
        console.print(f"{prompt!r}: the sample judge accepts {drawn[prompt]} of {len(result.judged)}")
    console.print(
        f"judging {settings.samples_per_prompt} images of each of the {len(SEEN_PROMPTS)} seen prompts and "
        f"the {len(HELDOUT_PROMPTS)} held-out compositions"
    )
    scores = judge_sample_prompts(settings.checkpoint_dir, settings.samples_per_prompt, settings.seed)
    report(Acceptance(drawn, settings.samples_per_prompt), scores, settings.out, console)
    return scores


def report(drawn: Acceptance, scores: dict[str, Acceptance], out: str, console: Console) -> None:
    table = Table(title="ttt demo: what the model drew", caption=f"PNGs and grids in {out}")
    table.add_column("prompt")
    table.add_column("in the training data")
    table.add_column("judge accepts", justify="right")
    for prompt in DEMO_PROMPTS:
        table.add_row(prompt, "yes" if prompt in SEEN_PROMPTS else "never (held out)", drawn.count_of(prompt))
    console.print(table)
    for kind, words in (("seen", "prompts it saw"), ("held out", "compositions it never saw")):
        score = scores[kind]
        console.print(f"[bold]the {len(score.accepted)} {words}: the judge accepts {score.summary()}[/]")
