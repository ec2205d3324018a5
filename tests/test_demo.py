"""`ttt demo`, the README's main job: preprocess the sample, train with local peers, generate, judge.

One run trains long enough to draw (one peer, 150 global steps, about 5 minutes here): the model it
makes must draw a prompt it saw so that the judge accepts it, and the counts the demo prints must be
the judge's verdicts on the PNGs it wrote. A short two-peer run on the same data checks the swarm's
mechanics and that the demo never overwrites another run's checkpoints.
"""

import json
import re
from pathlib import Path

import pytest
from PIL import Image

from inference.demo import DEMO_PROMPTS
from inference.generate import slug
from inference.sample_quality import SEEN_PROMPTS
from pipeline.sample.judge import judge
from tests.support.commands import run_ttt
from tests.support.swarm_runs import free_port

# Measured here: 8 of 8 red circles accepted after 150 steps (one peer, and two), 1 of 8 after 120 (two peers).
TRAINED_STEPS = 150
# 4 images of each of the 32 prompts make 64 of seen prompts for the share the demo prints, and 8 of the two seen
# prompts it draws (at least 2 must be accepted). Alone on this machine the demo took 144 s: preprocess 13 s, the
# 150 steps 112 s, drawing and judging 10 s.
SAMPLES_PER_PROMPT = 4
# The trained demo takes 4-5 minutes on this 2-core machine beside the other worker's tests, and 487 s to over 540 s
# on its slow days (clean-clone runs 90 and 92: preprocess 2.5 min, step 116 of 150 at 540 s): its command's and
# the first test's limits leave room for three times the usual.
DEMO_TIMEOUT = 1080
pytestmark = pytest.mark.timeout(DEMO_TIMEOUT + 120)


@pytest.fixture(scope="module")
def trained_demo(tmp_path_factory) -> tuple[Path, str, int]:
    """The trained demo's folder, what it printed, and the port it served the sample on: a free one, through the demo's
    `--sample-port`."""
    root, port = tmp_path_factory.mktemp("demo"), free_port()
    result = run_ttt("demo", "--peers", 1, "--steps", TRAINED_STEPS, "--samples-per-prompt", SAMPLES_PER_PROMPT,
                     "--dataset", root / "data", "--checkpoint-dir", root / "ckpt", "--out", root / "samples",
                     "--sample-port", port, timeout=DEMO_TIMEOUT)  # fmt: skip
    return root, result.stdout, port


def printed_counts(out: str) -> dict[str, int]:
    """What the demo says the judge accepted: a line per drawn prompt, its shares of all seen and held-out prompts."""
    out = " ".join(out.split())  # rich wraps long lines to the terminal's width
    line = "{!r}: the sample judge accepts (\\d+) of " + str(SAMPLES_PER_PROMPT)
    counts = {prompt: int(re.search(line.format(prompt), out).group(1)) for prompt in DEMO_PROMPTS}
    images = SAMPLES_PER_PROMPT * len(SEEN_PROMPTS)
    summary = rf"the judge accepts (\d+)% of {images} images \(95% CI (\d+)%-(\d+)%\)"
    for name, kind in (("seen %", "prompts it saw"), ("held-out %", "compositions it never saw")):
        share, low, high = (int(group) for group in re.search(f"the 16 {kind}: {summary}", out).groups())
        assert low <= share <= high
        counts[name] = share
    return counts


def test_the_demo_draws_prompts_it_saw_and_reports_what_the_judge_says(trained_demo):
    root, out, _ = trained_demo
    assert f"[peer 1] finished at global step {TRAINED_STEPS}" in out
    counts = printed_counts(out)
    rejudged = {}
    for prompt in DEMO_PROMPTS:
        images = sorted((root / "samples").glob(f"{slug(prompt)}-seed0-0*.png"))
        assert len(images) == SAMPLES_PER_PROMPT
        rejudged[prompt] = sum(judge(Image.open(path), prompt).match for path in images)
    assert {prompt: counts[prompt] for prompt in DEMO_PROMPTS} == rejudged
    seen = sum(rejudged[prompt] for prompt in DEMO_PROMPTS if prompt in SEEN_PROMPTS)
    assert seen >= 2, out  # the model draws what it was shown, not noise that happens to pass
    assert counts["seen %"] >= 25, out
    assert len(list((root / "samples").glob("*-grid.png"))) == len(DEMO_PROMPTS)


def test_two_peers_train_together_and_another_runs_checkpoints_are_never_overwritten(trained_demo, tmp_path):
    root, _, port = trained_demo
    result = run_ttt("demo", "--steps", "2", "--samples-per-prompt", "1", "--dataset", root / "data",
                     "--checkpoint-dir", tmp_path / "ckpt", "--out", tmp_path / "samples",
                     "--sample-port", port)  # fmt: skip
    out = result.stdout
    assert "resuming: 8 of 8 shards already written" in out  # the dataset of the first run, not made again
    assert "[peer 1] finished at global step 2" in out and "[peer 2] finished at global step 2" in out
    assert "ttt demo: what the model drew" in out and "the 16 compositions it never saw: the judge accepts" in out
    assert json.loads((tmp_path / "ckpt" / "latest.json").read_text())["step"] == 2
    assert len(list((tmp_path / "samples").glob("*-grid.png"))) == 4
    config = tmp_path / "ckpt" / "step-000002" / "config.json"
    config.write_text(config.read_text().replace('"ttt-demo"', '"my-real-run"'))
    refused = run_ttt("demo", "--checkpoint-dir", tmp_path / "ckpt", check=False)
    assert refused.returncode == 1 and "holds checkpoints of run 'my-real-run'" in refused.stderr
