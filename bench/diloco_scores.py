"""Do Gauntlet-style loss scores tell a DiLoCo attacker's pseudo-gradient from an honest one? (issue 51: "score each
pseudo-gradient the Gauntlet way", measured before it is built.)

DiLoCo peers are not audited (docs/training.md#checked-work): recomputing H inner steps costs what they cost.
Templar's Gauntlet instead scores a peer's update by the loss it takes off the rows the peer was given, against
the loss it takes off rows nobody was given. This bench measures whether that score separates honest peers from
attackers in ttt's setting (the tiny preset on the embedded sample, made by `ttt preprocess`), in one process, no
swarm: --peers honest peers take --local-steps inner steps each (the run's default inner optimizer, 8-bit LAMB,
on the preset's learning rate and a linear schedule over the bench) from the same outer parameters, on rows of
their own (consecutive batches of one shuffled stream, as leases give them: each row once per epoch), and the outer
step is the default one, the mean of their pseudo-gradients as a round delivers them (4 bits). Beside them, at
every outer step, the attackers, each from the same outer parameters and given rows of its own:

    free rider     sends zeros
    poisoner       trains honestly on its rows and sends its pseudo-gradient x -9 (under the 10x-median drop)
    copycat        sends an honest peer's pseudo-gradient of the outer step before
    wrong rows     trains (its own inner optimizer) on rows it chose: an honest peer's of the outer step before

Each pseudo-gradient (the honest ones and the attackers', 4-bit as a reducer receives them) is scored at the outer
parameters theta, on --eval-batches of the rows it was given (the sender's own batches) and as many rows nobody
was given this outer step:

    given      L_given(theta) - L_given(theta - delta): the loss it takes off its own rows
    other      L_other(theta) - L_other(theta - delta): off rows nobody trained on this outer step
    gap        given - other: Gauntlet's "it trained on the rows it was given"

each for the whole pseudo-gradient (what an auditor that fetched it could score), and for delta on one of --peers
equal slices of the flat parameter vector only (what one reducer of a round can score from the part it receives:
every slice's score counts). Each given and gap score is also divided by the median honest sender's of the same
outer step (and slice), "/ round": what an auditor can compare a sender with, a round's median sender being an
honest one where most are. For each score and each kind of sender: the median, the smallest and the largest, and
the share above 0 (of a score over the round's, above 0.5): an honest peer's should be 1 and an attacker's 0 for a
score that can drop it. And the cost: the seconds one whole-vector score takes against a peer's H inner steps.

Prints a table and writes every figure to bench/results/diloco-scores.json.

    .venv/bin/python -m bench.diloco_scores [--outer-steps 20] [--local-steps 10] [--peers 4] [--rows 2400]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from bench.common import save_results
from pipeline.core.stream import CodeStream
from tests.support.datasets import write_sample
from training.config import PRESETS
from training.model import DalleTransformer
from training.optimizer import linear_schedule, make_optimizer
from training.swarm.compression import pseudo_gradient_compression, round_trip

BATCH = 8
PRESET = PRESETS["tiny"]
ATTACKERS = ("free rider", "poisoner", "copycat", "wrong rows")
SCORES = ("given", "other", "gap")
RELATIVE = ("whole given / round", "whole gap / round", "slice given / round", "slice gap / round")

console = Console(width=140)


@dataclass
class Trainer:
    """One sender's model and inner optimizer, kept across outer steps as a DiLoCo peer keeps them."""

    model: DalleTransformer
    optimizer: torch.optim.Optimizer
    schedule: Callable[[int], float]

    @classmethod
    def make(cls, total_steps: int) -> Trainer:
        model = DalleTransformer(PRESET.model)
        optimizer = make_optimizer("lamb-8bit", model.parameters(), lr=PRESET.learning_rate)
        return cls(model, optimizer, linear_schedule(total_steps))

    def pseudo_gradient(self, outer: torch.Tensor, batches: list[dict], first_step: int) -> torch.Tensor:
        """theta - theta after H inner steps on `batches` from the outer parameters `outer` (a flat vector)."""
        vector_to_parameters(outer.clone(), self.model.parameters())  # its parameters become views of the copy
        for index, batch in enumerate(batches):
            for group in self.optimizer.param_groups:
                group["lr"] = PRESET.learning_rate * self.schedule(first_step + index)
            self.optimizer.zero_grad(set_to_none=True)
            self.model(batch["text"], batch["codes"])["loss"].backward()
            self.optimizer.step()
        return outer - parameters_to_vector(self.model.parameters()).detach()


@dataclass
class Auditor:
    """Scores pseudo-gradients at the outer parameters: the loss they take off the given rows and off others."""

    model: DalleTransformer
    slices: int
    seconds: list[float] = field(default_factory=list)  # per whole-vector score of the given rows: two forwards

    def loss(self, parameters: torch.Tensor, batches: list[dict]) -> float:
        vector_to_parameters(parameters, self.model.parameters())
        with torch.no_grad():
            return statistics.fmean(self.model(b["text"], b["codes"])["loss"].item() for b in batches)

    def slice_improvements(self, outer: torch.Tensor, delta: torch.Tensor, batches: list[dict], base: float) -> list:
        """The loss each slice of `delta` alone takes off `batches`."""
        found = []
        for piece in torch.tensor_split(torch.arange(delta.numel()), self.slices):
            moved = outer.clone()
            moved[piece] -= delta[piece]
            found.append(base - self.loss(moved, batches))
        return found

    def score(self, outer: torch.Tensor, delta: torch.Tensor, given: list[dict], other: list[dict], base: dict) -> dict:
        """Each score of `delta`, whole (one value) and by slice (one value per slice)."""
        started = time.perf_counter()
        base_given = self.loss(outer, given)
        whole_given = base_given - self.loss(outer - delta, given)
        self.seconds.append(time.perf_counter() - started)
        given_scores = [whole_given, *self.slice_improvements(outer, delta, given, base_given)]
        whole_other = base["other"] - self.loss(outer - delta, other)
        other_scores = [whole_other, *self.slice_improvements(outer, delta, other, base["other"])]
        gap = [a - b for a, b in zip(given_scores, other_scores, strict=True)]
        found = {}
        for name, values in zip(SCORES, (given_scores, other_scores, gap), strict=True):
            found[f"whole {name}"], found[f"slice {name}"] = values[:1], values[1:]
        return found


def relative_to_the_round(found: dict[str, dict], honest: list[str]) -> None:
    """Add each sender's given and gap scores over the median honest sender's of the same outer step (and slice): what
    an auditor can compare with, a round's median sender being an honest one where most are."""
    for name in RELATIVE:
        key = name.removesuffix(" / round")
        medians = [statistics.median(found[peer][key][i] for peer in honest) for i in range(len(found[honest[0]][key]))]
        for scores in found.values():
            scores[name] = [value / median for value, median in zip(scores[key], medians, strict=True)]


def run(dataset: Path, args: argparse.Namespace) -> dict:
    """Every outer step's scores, by kind of sender."""
    torch.manual_seed(args.seed)
    total_steps = args.outer_steps * args.local_steps
    honest = [Trainer.make(total_steps) for _ in range(args.peers)]
    attacker, wrong_rows = Trainer.make(total_steps), Trainer.make(total_steps)
    outer = parameters_to_vector(DalleTransformer(PRESET.model).parameters()).detach()  # the seed's initialisation
    auditor = Auditor(DalleTransformer(PRESET.model), args.peers)
    compression = pseudo_gradient_compression(4)
    batches = endless_batches(dataset, args.seed)
    scores: dict[str, list[dict]] = defaultdict(list)
    train_seconds, previous = [], None
    for step in range(args.outer_steps):
        rows = [[next(batches) for _ in range(args.local_steps)] for _ in range(args.peers + 1)]
        other = [next(batches) for _ in range(args.eval_batches)]
        first = step * args.local_steps
        started = time.perf_counter()
        deltas = [peer.pseudo_gradient(outer, given, first) for peer, given in zip(honest, rows, strict=False)]
        train_seconds.append((time.perf_counter() - started) / args.peers)
        sent = {f"honest {i}": (delta, rows[i]) for i, delta in enumerate(deltas)}
        sent["free rider"] = (torch.zeros_like(outer), rows[-1])
        sent["poisoner"] = (-9 * attacker.pseudo_gradient(outer, rows[-1], first), rows[-1])
        if previous is not None:
            sent["copycat"] = (previous[0], rows[-1])
            sent["wrong rows"] = (wrong_rows.pseudo_gradient(outer, previous[1], first), rows[-1])
        base = {"other": auditor.loss(outer, other)}
        found = {name: auditor.score(outer, round_trip(compression, delta), given[: args.eval_batches], other, base)
                 for name, (delta, given) in sent.items()}  # fmt: skip
        relative_to_the_round(found, [name for name in found if name.startswith("honest")])
        for name, entry in found.items():
            scores["honest" if name.startswith("honest") else name].append(entry)
        previous = (deltas[0], rows[0])
        outer = outer - torch.stack([round_trip(compression, delta) for delta in deltas]).mean(dim=0)
        console.print(f"outer step {step}: loss on rows nobody was given {base['other']:.3f}")
    return {"scores": scores, "train_seconds": statistics.fmean(train_seconds),
            "score_seconds": statistics.fmean(auditor.seconds)}  # fmt: skip


def endless_batches(dataset: Path, seed: int) -> Iterator[dict]:
    """The sample's batches in one shuffled order, epoch after epoch: each row once per epoch, as leases read it."""
    stream = CodeStream(dataset, batch_size=BATCH, text_len=PRESET.model.text_len, seed=seed)
    while True:
        yield from stream


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "above_0": sum(value > 0 for value in values) / len(values),
            "above_half": sum(value > 0.5 for value in values) / len(values), "count": len(values)}  # fmt: skip


def summarise(scores: dict[str, list[dict]]) -> dict:
    """For each kind of sender and each score: the figures of its values over every outer step (and slice)."""
    return {kind: {name: summary([value for entry in entries for value in entry[name]]) for name in entries[0]}
            for kind, entries in scores.items()}  # fmt: skip


def print_results(results: dict) -> None:
    title = (f"{results['peers']} honest peers, H={results['local_steps']}, {results['outer_steps']} outer steps, "
             f"tiny preset on the sample: loss taken off")  # fmt: skip
    table = Table(title=title)
    table.add_column("score")
    for kind in ("honest", *ATTACKERS):
        table.add_column(f"{kind}\nmedian (min..max) share", justify="right")
    for name in next(iter(results["summary"].values())):
        cells = []
        for kind in ("honest", *ATTACKERS):
            s = results["summary"][kind][name]
            share = s["above_half"] if name in RELATIVE else s["above_0"]
            cells.append(f"{s['median']:+.3f} ({s['min']:+.2f}..{s['max']:+.2f}) {share:.0%}")
        table.add_row(name, *cells)
    console.print("share: of the values above 0; of a score over the round's median, above 0.5")
    console.print(table)
    console.print(
        f"one whole-vector score: {results['score_seconds']:.3f} s; a peer's {results['local_steps']} inner steps: "
        f"{results['train_seconds']:.2f} s ({results['score_seconds'] / results['train_seconds']:.1%})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--outer-steps", type=int, default=20)
    parser.add_argument("--local-steps", type=int, default=10, help="H: inner steps between outer steps")
    parser.add_argument("--peers", type=int, default=4, help="honest peers, and slices of a round")
    parser.add_argument("--rows", type=int, default=2400, help="rows of the sample")
    parser.add_argument("--eval-batches", type=int, default=2, help="batches of 8 rows each score reads, each side")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dataset", type=Path, help="an existing preprocessed sample, instead of making one")
    args = parser.parse_args()
    torch.set_num_threads(2)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        dataset = args.dataset or Path(tmp)
        if args.dataset is None:
            console.print(f"making the sample ({args.rows} rows, ttt preprocess)")
            write_sample(dataset, args.rows)
        found = run(dataset, args)
    results = {"peers": args.peers, "local_steps": args.local_steps, "outer_steps": args.outer_steps,
               "eval_batches": args.eval_batches, "rows": args.rows, "seed": args.seed,
               "train_seconds": found["train_seconds"], "score_seconds": found["score_seconds"],
               "summary": summarise(found["scores"]), "scores": found["scores"]}  # fmt: skip
    print_results(results)
    save_results("diloco-scores", results, started, console)


if __name__ == "__main__":
    main()
