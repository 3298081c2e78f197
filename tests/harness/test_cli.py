"""`unified-attn check` and `unified-attn migrate`: exit codes and JSON output."""

import json

import pytest

from unified_attn.cli import main

WRONG = "tests.harness.wrong_backends:"


def run(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr()


def test_check_passes_reference_with_json(capsys):
    code, out = run(capsys, "check", "reference", "--json")
    report = json.loads(out.out)
    assert code == 0 and report["ok"] and report["backend"] == "reference"


def test_check_fails_a_wrong_backend_with_a_table(capsys):
    code, out = run(capsys, "check", WRONG + "IgnoresWindowBackend")
    assert code == 1
    assert "sliding window 8" in out.out and "FAIL" in out.out


def test_migrate_passes_and_fails(capsys):
    code, out = run(capsys, "migrate", "--legacy", "reference", "--native", "reference", "--small")
    assert code == 0 and "PASS" in out.out
    code, out = run(
        capsys,
        "migrate",
        "--legacy",
        "reference",
        "--native",
        WRONG + "WrongScaleBackend",
        "--small",
        "--json",
    )
    assert code == 1 and json.loads(out.out)["failures"]


@pytest.mark.parametrize(
    "argv", [["check", "nosuch"], ["migrate", "--legacy", "x:Y", "--native", "reference"]]
)
def test_unknown_backends_exit_2_with_a_message(capsys, argv):
    code, out = run(capsys, *argv)
    assert code == 2 and "error:" in out.err
