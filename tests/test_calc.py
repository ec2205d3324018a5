"""The memory calculator (`ttt calc`): published shapes, predictions held to real tensors, `--batch-size auto`."""

import json
import re
import signal

import pytest

from tests.support.commands import PEER_ARGS, run_ttt
from training.audit.auditor import SNAPSHOTS_KEPT
from training.calc.measure import (
    measure_activations,
    measure_audit_snapshots,
    measure_optimizer_state,
    measure_parameters_and_gradients,
    measure_swarm_buffers,
)
from training.calc.memory import (
    AUDIT_SNAPSHOTS,
    MODELS,
    PUBLISHED_PARAMETERS,
    Setup,
    architecture_of,
    estimate,
    largest_batch,
    train_setup,
)
from training.config import PRESETS, ModelConfig


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_the_paper_calculators_models_have_their_published_sizes(name):
    count = MODELS[name].parameter_count()
    assert abs(count / PUBLISHED_PARAMETERS[name] - 1) < 0.05, (name, count)


@pytest.mark.parametrize("share", [True, False])
def test_predictions_match_the_tensors_of_the_tiny_model(share):
    """Parameters, gradients and 8-bit state to the byte; activations within 10% (they match to the byte too)."""
    for reversible in (False, True):
        config = ModelConfig(**{**PRESETS["tiny"].model.to_dict(), "share_groups": share, "reversible": reversible})
        model = architecture_of("tiny", config)
        for batch in (1, 3):
            predicted = estimate(model, Setup(batch_size=batch, reversible=reversible))
            assert abs(predicted.activations / measure_activations(config, batch) - 1) < 0.10
    predicted = estimate(model, Setup())
    assert measure_parameters_and_gradients(config) == (predicted.parameters, predicted.gradients)
    for optimizer in ("lamb-8bit", "lamb", "adam-8bit", "adamw", "adamw-16bit"):
        predicted = estimate(model, Setup(optimizer=optimizer))
        assert measure_optimizer_state(config, optimizer) == predicted.optimizer_state, optimizer


def test_a_ttt_train_peers_hivemind_buffers_are_predicted_to_the_byte():
    config = PRESETS["tiny"].model
    predicted = estimate(architecture_of("tiny", config), train_setup(config, 4))
    ctrl_c = signal.getsignal(signal.SIGINT)
    measured = measure_swarm_buffers(config, 4)
    assert measured == {term: getattr(predicted, term) for term in measured}
    # hivemind's averagers set SIGINT to "ignore" in the process that starts them (which every later child inherits)
    assert signal.getsignal(signal.SIGINT) is ctrl_c


def test_an_auditing_peers_second_model_and_kept_parameters_are_predicted_to_the_byte():
    config = PRESETS["tiny"].model
    model = architecture_of("tiny", config)
    predicted = estimate(model, train_setup(config, 4, audit_rate=0.1))
    assert predicted.audit_model == sum(measure_parameters_and_gradients(config))  # a second model, recomputing
    assert predicted.audit_snapshots == measure_audit_snapshots(config) and AUDIT_SNAPSHOTS == SNAPSHOTS_KEPT
    alone = estimate(model, train_setup(config, 4))
    assert predicted.device_total - alone.device_total >= predicted.audit_model
    assert predicted.host_total - alone.host_total == predicted.audit_snapshots
    diloco = estimate(model, train_setup(config, 4, local_steps=50, audit_rate=0.1))  # DiLoCo runs are not audited
    assert diloco.audit_model == diloco.audit_snapshots == 0


def test_the_largest_batch_is_the_last_that_fits():
    model, setup = MODELS["ttt-1.1b"], Setup(offload=True, reversible=True)
    budget = 8 * 2**30
    batch = largest_batch(model, setup, budget, on_gpu=True)
    assert batch > 1
    fits = [
        estimate(model, Setup(batch_size=b, offload=True, reversible=True)).device_total <= budget
        for b in (batch, batch + 1)
    ]
    assert fits == [True, False]
    assert largest_batch(model, setup, 2**20, on_gpu=True) == 0


def test_ttt_calc_prints_a_table_and_json_for_scripts():
    table = run_ttt("calc", "--preset", "ttt-1.1b", "--batch-size", "1", "--offload", "--reversible", "--fit", "8")
    assert "ttt-1.1b: 93.7 M parameters" in table.stdout and "GPU memory" in table.stdout
    assert re.search(r"the largest --batch-size that fits 8 GiB of GPU memory: \d+", table.stdout)
    custom = run_ttt("calc", "--layers", "24", "--width", "1024", "--heads", "16", "--seq-len", "1280", "--vocab",
                     "16384", "--json")  # fmt: skip
    document = json.loads(custom.stdout)
    assert document["model"] == "custom" and document["parameters_count"] > 300e6
    assert document["device_total"] > document["parameters"] + document["gradients"] + document["activations"]


def test_calc_mistakes_are_one_line():
    cases = [
        (["--layers", "2", "--width", "100", "--heads", "3", "--seq-len", "8", "--vocab", "10"], "not divisible by 3"),
        (["--layers", "-2", "--width", "96", "--heads", "3", "--seq-len", "8", "--vocab", "10"], "--layers must be"),
        (["--preset", "gpt5"], "preset 'gpt5' is unknown"),
        (["--preset", "tiny", "--width", "64"], "not both"),
        (["--preset", "ttt-1.1b", "--seq-len", "64"], "leave --seq-len out"),
        (["--preset", "tiny", "--fit", "nan"], "--fit must be a positive number"),
        (["--preset", "tiny", "--reversible", "--checkpointing"], "not both"),
    ]
    for args, message in cases:
        result = run_ttt("calc", *args, check=False)
        assert result.returncode == 1 and "Traceback" not in result.stderr, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (args, result.stderr)


def test_batch_size_auto_picks_what_fits_a_small_memory_limit_and_trains(sample_dataset, tmp_path):
    args = [arg if arg != "8" else "auto" for arg in PEER_ARGS]  # --batch-size auto
    result = run_ttt("train", "--dataset", sample_dataset, "--run-id", "auto-batch", *args, "--max-memory", "0.09",
                     "--max-steps", "2", "--checkpoint-dir", tmp_path / "ck")  # fmt: skip
    chosen = int(re.search(r"--batch-size auto: (\d+) \(needs about", result.stdout).group(1))
    config = PRESETS["tiny"].model
    expected = largest_batch(
        architecture_of("tiny", config), train_setup(config, 1, audit_rate=0.1), int(0.9 * 0.09 * 2**30), False, 32
    )
    assert chosen == expected and 1 < chosen < 32
    assert re.search(r"^step\s+2 ", result.stdout, re.M), result.stdout
