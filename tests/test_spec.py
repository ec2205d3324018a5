"""The run spec (training/spec.py): written once by the organiser (`ttt run init`), read from a file, from the swarm
or from the monitor's page, and the one line a volunteer gets when the spec and the command line disagree. The
swarm fixture's volunteers join with `--join` alone (tests/test_train.py)."""

from dataclasses import replace

import pytest

from cli import RUN_OPTIONS
from tests.support.commands import run_ttt
from training.auth.commands import init_authority
from training.auth.keys import load_authority_public_key
from training.config import RunSettings, RunSpec
from training.spec import SpecError, adopt, choose_spec, init_spec, read_spec, signed_spec, signer

HELPS = {name: option["help"] for name, option in RUN_OPTIONS.items()}
SETTINGS = RunSettings(run_id="spec-run", preset="small", learning_rate=2e-3, local_steps=50, outer_momentum=0.9)


@pytest.fixture
def authority(tmp_path):
    init_authority("spec-run", tmp_path / "authority")
    return tmp_path / "authority"


def test_a_spec_file_holds_every_run_setting_and_a_signature_that_an_edit_breaks(tmp_path, authority):
    path = tmp_path / "run.toml"
    init_spec(SETTINGS, path, authority, overwrite=False, helps=HELPS)
    spec = read_spec(path)
    assert spec.settings == SETTINGS and signer(spec) is not None
    text = path.read_text()
    assert "# Peak LR [default: the preset's]." in text and "# tokenizer =  (unset)" in text
    with pytest.raises(SpecError, match="exists; pass --overwrite"):
        init_spec(SETTINGS, path, authority, overwrite=False, helps=HELPS)
    path.write_text(text.replace("learning_rate = 0.002", "learning_rate = 0.02"))
    with pytest.raises(SpecError, match="its signature does not hold"):
        read_spec(path)
    init_spec(SETTINGS, path, None, overwrite=True, helps=HELPS)
    assert read_spec(path) == RunSpec(SETTINGS)  # unsigned
    with pytest.raises(SpecError, match="is run 'spec-run''s, not 'other''s"):
        signed_spec(replace(SETTINGS, run_id="other"), authority)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('run_id = "x"\nprest = "tiny"\n', "prest is not a run setting; the settings are run_id, dataset, preset"),
        ('run_id = "x"\npreset = 3\n', "preset = 3 must be a string"),
        ('run_id = "x"\nlearning_rate = "fast"\n', "learning_rate = 'fast' must be a number or left out"),
        ('run_id = "x"\noptimizer = "sgd"\n', "optimizer = 'sgd'; choose one of lamb-8bit"),
        ('run_id = "x"\nlocal_steps = true\n', "local_steps = True must be an integer"),
        ('preset = "tiny"\n', "names no run_id"),
        ("run_id = x\n", "is not TOML"),
        ('run_id = "x"\nauthority = 3\n', "[authority] must be a table"),
    ],
)
def test_a_spec_file_that_is_not_a_runs_is_one_line(tmp_path, content, message):
    path = tmp_path / "run.toml"
    path.write_text(content)
    with pytest.raises(SpecError, match=r"^--run .*run\.toml") as raised:
        read_spec(path)
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_an_integer_stands_for_a_float_as_toml_writes_it(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('run_id = "x"\nouter_lr = 1\nweight_decay = 0\n')
    settings = read_spec(path).settings
    assert settings.outer_lr == 1.0 and isinstance(settings.outer_lr, float) and settings.weight_decay == 0.0


def test_options_given_beside_the_spec_must_agree_except_where_this_machine_keeps_the_data():
    spec = RunSpec(SETTINGS)
    given = replace(RunSettings(), run_id="spec-run", dataset="/mnt/copy", optimizer="adam-8bit")
    assert adopt(spec, given, ("run_id", "dataset")) == replace(SETTINGS, dataset="/mnt/copy")
    with pytest.raises(SpecError) as raised:
        adopt(spec, given, ("optimizer",))
    assert str(raised.value) == (
        "--optimizer adam-8bit contradicts run 'spec-run', which trains with --optimizer lamb-8bit; leave the option "
        "out to train with the run's"
    )


def test_a_joining_peer_takes_its_runs_spec_and_refuses_to_guess(authority):
    signed = signed_spec(SETTINGS, authority)
    unsigned, other_run = RunSpec(replace(SETTINGS, seed=5)), RunSpec(replace(SETTINGS, run_id="other"))
    forged = replace(signed, settings=replace(SETTINGS, learning_rate=1.0))  # the signature of other settings
    key = load_authority_public_key(authority / "run.pub")
    assert choose_spec([signed, signed], None, None, "X") == signed  # every peer publishes the same
    assert choose_spec([signed, forged], None, None, "X") == signed  # a signature that does not hold is left out
    assert choose_spec([signed, unsigned, other_run], "spec-run", key, "X") == signed
    assert choose_spec([unsigned, other_run], "other", None, "X") == other_run
    with pytest.raises(SpecError, match=r"several runs share the swarm at X \(other, spec-run\); add --run-id NAME"):
        choose_spec([unsigned, other_run], None, None, "X")
    assert choose_spec([unsigned, signed], None, None, "X") == signed  # a signed spec outranks unsigned ones
    with pytest.raises(SpecError, match="holds 2 different specs of run 'spec-run'"):
        choose_spec([unsigned, RunSpec(SETTINGS)], None, None, "X")
    with pytest.raises(SpecError, match="no spec at X is signed by --authority-key"):
        choose_spec([unsigned, forged], None, key, "X")
    with pytest.raises(SpecError, match="no peer at X has published the spec of run 'nope'"):
        choose_spec([signed], "nope", None, "X")


def test_ttt_train_refuses_a_run_option_that_contradicts_the_spec_in_one_line(tmp_path):
    spec = tmp_path / "run.toml"
    run_ttt("run", "init", "--run-id", "cli-run", "--local-steps", "10", "--out-file", spec)
    results = [
        run_ttt("train", "--run", spec, "--local-steps", "20", check=False),
        run_ttt("train", "--run", spec, "--join", "http://127.0.0.1:9", check=False),
        run_ttt("run", "init", "--preset", "tiny", "--out-file", tmp_path / "other.toml", check=False),
    ]
    lines = [result.stderr.strip().splitlines()[-1] for result in results]
    assert all(result.returncode != 0 and "Traceback" not in result.stderr for result in results)
    assert lines == [
        "Error: --local-steps 20 contradicts run 'cli-run', which trains with --local-steps 10; leave the option out "
        "to train with the run's",
        "Error: --join and --run both give the run's settings; give one of them",
        "Error: name the run: --run-id NAME",
    ]
