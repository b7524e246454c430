"""`edgeprobe CMD --help` tells a newcomer what CMD does and what its options accept."""
import pytest

from edgeprobe.cli import build_parser
from edgeprobe.quant.schemes import SCHEMES


def _help(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("cmd,words", [("generate", "Continue a prompt"), ("schedule", "Cut a prompt into chunks"),
                                       ("quantize", "Quantize a model"), ("run", "Run a quantized prefill")])
def test_each_command_says_what_it_does(capsys, cmd, words):
    text = _help(capsys, cmd)
    description = text.split("\n\n")[1]  # argparse: usage, then the description, then the options
    assert description.startswith(words)
    assert "--json" in text and all(h.strip() for h in text.split("--json")[1:2])


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
