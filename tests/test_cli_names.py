"""One name per concept across ttt's commands, and the old names of renamed options: each still works (hidden from
--help) and says its new name in one line on stderr."""

from __future__ import annotations

import click
import pytest

import cli
from pipeline.core.renamed_options import RenamingCommand

FOLDER = "{folder}"  # an existing folder, for the options that check it
# Each old spelling and the same in the new names: both must parse to the same values.
OLD_AND_NEW = [
    (("preprocess",), ["--output", "x"], ["--dataset", "x"]),
    (("stream-bench",), ["x", "--seconds", "1"], ["--dataset", "x", "--seconds", "1"]),
    (("publish",), [FOLDER, "hf://datasets/o/n"], ["--dataset", FOLDER, "hf://datasets/o/n"]),
    (
        ("inspect",),
        ["--show", "0", FOLDER, "--out", "a.png"],
        ["--show", "0", "--dataset", FOLDER, "--out-file", "a.png"],
    ),
    (("calc",), ["--model", "tiny"], ["--preset", "tiny"]),
    (("calc",), ["--model=tiny", "--json"], ["--preset=tiny", "--json"]),
    (("train",), ["--client-mode", "--run-id", "r"], ["--reachability", "client", "--run-id", "r"]),
    (("monitor",), ["--client-mode"], ["--reachability", "client"]),
    (("auth", "keygen"), ["--out", "bob.key"], ["--out-file", "bob.key"]),
    (
        ("auth", "issue"),
        ["--user", "bob", "--peer-key", "bob.pub", "--out", "t", "--lifetime", "60"],
        ["--user", "bob", "--peer-key", "bob.pub", "--out-file", "t", "--token-lifetime", "60"],
    ),
]


def commands(group: click.Group = cli.main, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], click.Command]:
    """Every command of the CLI by its words (`("auth", "issue")`)."""
    found = {}
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            found.update(commands(command, (*path, name)))
        else:
            found[(*path, name)] = command
    return found


def parsed(words: tuple[str, ...], args: list[str]) -> dict:
    return commands()[words].make_context(" ".join(words), list(args)).params


@pytest.mark.parametrize(("words", "old", "new"), OLD_AND_NEW, ids=lambda value: " ".join(value))
def test_an_old_name_still_works_and_says_its_new_one(words, old, new, tmp_path, capsys):
    old, new = ([str(tmp_path) if arg == FOLDER else arg for arg in args] for args in (old, new))
    assert parsed(words, new) == parsed(words, old)
    notices = capsys.readouterr().err.splitlines()
    assert notices and all(line.startswith("note: ") and "is now --" in line for line in notices), notices


def test_every_renamed_option_is_checked_here():
    checked = {(words, arg.partition("=")[0]) for words, old, _ in OLD_AND_NEW for arg in old}
    checked |= {(words, "positional") for words, old, new in OLD_AND_NEW if "--dataset" in set(new) - set(old)}
    renamed = {
        (words, old)
        for words, command in commands().items()
        if isinstance(command, RenamingCommand)
        for old in [*command.renamed, *(["positional"] if command.positional else [])]
    }
    assert renamed <= checked, renamed - checked


def test_one_name_per_concept():
    """--out is a folder and --out-file a file; a dataset is --dataset, never an argument; a model shape is --preset;
    and no command declares a name it has renamed."""
    for words, command in commands().items():
        renamed = set(command.renamed) if isinstance(command, RenamingCommand) else set()
        for param in command.params:
            where = f"ttt {' '.join(words)} {param.name}"
            assert not set(param.opts) & (renamed | {"--model"}), where
            assert not (isinstance(param, click.Argument) and param.name in ("dataset", "folder")), where
            if "--out" in param.opts and isinstance(param.type, click.Path):
                assert param.type.file_okay is False, where
            if "--out-file" in param.opts:
                assert isinstance(param.type, click.Path) and param.type.dir_okay is False, where


def test_help_lists_the_new_names_only():
    calc = commands()[("calc",)]
    text = calc.get_help(click.Context(calc, info_name="calc"))
    assert "--preset NAME" in text and "--model" not in text
