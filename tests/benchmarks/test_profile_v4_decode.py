"""`benchmarks/profile_v4_decode.py --hopper`: configurations parse, bad ones give one line and
exit code 2 (no GPU needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "profile_v4_decode.py"


def test_hopper_configurations_are_parsed(bench):
    configs = bench.parse_hopper("64/2/1,32/4/1/2")
    assert [(c.tile, c.num_stages, c.splits, c.halves) for c in configs] == [
        (64, 2, 1, 0),
        (32, 4, 1, 2),
    ]


@pytest.mark.parametrize("text", ["64/2", "64/2/1/2/1", "a/b/c", "48/2/1", "64/1/1", "64/2/1/5"])
def test_bad_hopper_configurations_exit_with_code_2_and_one_line(bench, capsys, text):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--hopper", text])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--hopper takes TILE/STAGES/SPLITS" in err
