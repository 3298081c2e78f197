"""`check` drives every KV-cache manager a backend returns through an engine under memory
pressure (tests/harness/buggy_managers.py plants one bug per manager kind; the shipped
managers and the custom-managers guide's policy pass), and a backend that serves decoder
layers only gets its other cells reported unsupported, with its reason."""

import json

import pytest

from unified_attn.backends.reference import ReferenceAttentionBackend
from unified_attn.cli import main
from unified_attn.harness.conformance.conformance_run import run_conformance
from unified_attn.harness.conformance.manager_cells import manager_cells

BUGGY = "tests.harness.buggy_managers:"


def test_the_shipped_managers_pass_and_say_what_they_exercised():
    rows = manager_cells(ReferenceAttentionBackend, "cpu")
    assert [r["status"] for r in rows] == ["pass"] * 4
    exercised = {r["cell"]: r["exercised"] for r in rows}
    assert all(e["blocks poisoned"] > 0 for e in exercised.values())
    assert sum(e["preemptions"] for e in exercised.values()) > 0
    assert exercised["manager: sliding window 32"]["blocks recycled"] > 0
    assert exercised["manager: full attention"]["hit blocks"] > 0


@pytest.mark.parametrize(
    "backend, cell, message",
    [
        ("FreesInsideTheWindowBackend", "manager: sliding window 32",
         "FreesInsideTheWindow: request r0 generated other tokens than with ample memory"),
        ("DropsAHitBlockBackend", "manager: full attention",
         "DropsAHitBlock: request r4 generated other tokens than with ample memory"),
        ("UnderstatesItsCapBackend", "manager: sliding window 32",
         "UnderstatesItsCap: request r2 holds 5 blocks, more than its max_blocks_per_request() "
         "= 4"),
    ],
)  # fmt: skip
def test_a_planted_manager_bug_fails_its_cell_naming_the_manager(backend, cell, message):
    from tests.harness import buggy_managers

    rows = {r["cell"]: r for r in manager_cells(getattr(buggy_managers, backend), "cpu")}
    assert rows[cell]["status"] == "fail" and message in rows[cell]["detail"]
    others = [r["status"] for name, r in rows.items() if name != cell]
    assert set(others) <= {"pass"}


def test_check_fails_a_buggy_policy_on_the_command_line(capsys):
    assert main(["check", BUGGY + "FreesInsideTheWindowBackend", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    (failed,) = [r for r in report["cells"] if r["status"] == "fail"]
    assert failed["detail"].startswith("FreesInsideTheWindow: request r0 generated other tokens")


def test_the_custom_managers_guide_policy_passes_check():
    report = run_conformance("tests.harness.user_policy:SinkAndWindowReference")
    assert report["ok"] and report["failed"] == 0 and report["unsupported"] == 0
    managers = [r for r in report["cells"] if r["type"] == "manager"]
    assert len(managers) == 4 and {r["status"] for r in managers} == {"pass"}


def test_a_decoder_only_backend_has_its_other_cells_unsupported_with_its_reason():
    report = run_conformance("tests.harness.user_decoder_only:WindowOnlyDecoder")
    assert report["ok"] and report["failed"] == 0
    other = [r for r in report["cells"] if r["type"] in ("encoder", "encoder_only",
                                                          "encoder_decoder")]  # fmt: skip
    assert other and all(r["status"] == "unsupported" for r in other)
    assert all(r["detail"].startswith("serves decoder layers only") for r in other)


def test_a_crashing_cell_names_the_backends_frame(tmp_path, monkeypatch, capsys):
    """The guide's old backend unpacked `super().get_cache_config()` on encoder layers."""
    (tmp_path / "old_guide.py").write_text(
        "from unified_attn.backends.reference import ReferenceAttentionBackend\n\n\n"
        "class Old(ReferenceAttentionBackend):\n"
        "    name = 'old-guide'\n\n"
        "    def get_cache_config(self):\n"
        "        manager, config, spec = super().get_cache_config()\n"
        "        return manager, config, spec\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    report = run_conformance("old_guide:Old")
    crashed = [r for r in report["cells"] if r["status"] == "fail"]
    assert crashed and all("(in old_guide.py:8, get_cache_config)" in r["detail"] for r in crashed)
    assert main(["check", "old_guide:Old", "--verbose"]) == 1
    assert "Traceback" in capsys.readouterr().out


def test_a_backend_written_from_the_porting_guide_passes_check():
    report = run_conformance("tests.harness.user_backend_from_scratch:ScratchBackend")
    assert report["ok"] and report["failed"] == 0
    reasons = {r["cell"]: r.get("detail", "") for r in report["cells"] if r["status"] != "pass"}
    assert reasons["soft cap 2"] == "a logits soft cap is not supported"  # declared, not failed
    passed = {r["cell"] for r in report["cells"] if r["status"] == "pass"}
    assert {"decode", "sliding window 8", "manager: sliding window 32"} <= passed
