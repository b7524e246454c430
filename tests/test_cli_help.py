"""`edgeprobe CMD --help` tells a newcomer what CMD does and what its options accept."""
import pytest

from edgeprobe.cli import build_parser
from edgeprobe.quant.schemes import SCHEMES


def _help(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def _commands() -> dict:
    import argparse

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_there_are_commands_to_describe():
    assert {"generate", "schedule", "quantize", "run", "eval", "profile", "demo"} <= set(_commands())


@pytest.mark.parametrize("cmd", sorted(_commands()))
def test_each_command_says_what_it_does(capsys, cmd):
    """Every command's --help opens with its own description (a sentence) and lists every option it takes."""
    parser = _commands()[cmd]
    assert parser.description and parser.description.rstrip().endswith((".", ")")), parser.description
    text = _help(capsys, cmd)
    shown = " ".join(text.split("\n\n")[1].split())  # argparse: usage, then the description, then the options
    assert shown.startswith(" ".join(parser.description.split())[:60])
    for action in parser._actions:
        assert not action.option_strings or action.option_strings[-1] in text, (cmd, action.option_strings)


@pytest.mark.parametrize("cmd", ["run", "quantize", "eval"])
def test_scheme_lists_its_choices(capsys, monkeypatch, cmd):
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping inside a scheme name
    assert "(choices: " + ", ".join(SCHEMES) + ")" in _help(capsys, cmd)


def test_profile_kind_help_shows_only_that_profile(capsys):
    outliers = _help(capsys, "profile", "outliers")
    assert "--percentile" in outliers and "--eps" not in outliers and "--heldout" not in outliers
    sparsity = _help(capsys, "profile", "sparsity")
    assert "--eps" in sparsity and "--percentile" not in sparsity and "--bit-widths" not in sparsity
    args = build_parser().parse_args(["profile", "outliers", "--out", "o", "--prune-rate", "0.5"])
    assert (args.what, args.prune_rate, args.eps) == ("outliers", 0.5, 0.01)  # old command lines parse as before
