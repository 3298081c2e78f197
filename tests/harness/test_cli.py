"""`unified-attn`: `check` and `migrate` exit codes and JSON output; one naming of backends
(`run` takes what `check` and `migrate` take); `backends`, `models`, `--version`, `--help`."""

import json
import os
import subprocess
import sys

import pytest
import torch

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


def test_check_takes_the_state_backends_and_fails_a_planted_bug(capsys):
    code, out = run(capsys, "check", "mamba2", "--json")
    report = json.loads(out.out)
    assert code == 0 and report["ok"] and {r["type"] for r in report["cells"]} == {"mamba2"}
    code, out = run(capsys, "check", "tests.harness.buggy_state_backends:Mamba2NoDraftRollback")
    assert code == 1 and "Mamba-2" in out.out and "drafts rejected" in out.out


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


# ---- one naming of backends, the listing commands, --version and --help ----------------------

FAST = ["--num-requests", "2", "--max-tokens", "2", "--json"]

MY_BACKENDS = '''
from unified_attn.backends.reference import ReferenceAttentionBackend
from unified_attn.legacy_adapter.ports.legacy_reference import LegacyReferenceBackend


class CwdBackend(ReferenceAttentionBackend):
    name = "cwd-native"


class CwdLegacyBackend(LegacyReferenceBackend):
    """A four-class backend: `run` wraps it in LegacyBackendAdapter."""
'''


@pytest.mark.parametrize(
    "backend, name",
    [
        ("reference", "reference"),
        ("legacy-reference", "legacy-reference"),
        ("cwd_backends_for_run:CwdBackend", "cwd-native"),
        ("cwd_backends_for_run:CwdLegacyBackend", "legacy-reference"),
    ],
)
def test_run_takes_every_backend_name_check_and_migrate_take(
    capsys, monkeypatch, tmp_path, backend, name
):
    (tmp_path / "cwd_backends_for_run.py").write_text(MY_BACKENDS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # run puts the cwd on it
    monkeypatch.delitem(sys.modules, "cwd_backends_for_run", raising=False)
    code, out = run(capsys, "run", "--backend", backend, *FAST)
    assert code == 0, out.err
    report = json.loads(out.out)
    assert report["backend"] == name and report["num_requests"] == 2


def test_the_engine_takes_legacy_names_too():
    from unified_attn import LLMEngine, SamplingParams

    engine = LLMEngine("tiny-llama", backend="legacy-reference", max_model_len=64)
    assert engine.backend_cls.name == "legacy-reference"
    (out,) = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert len(out.output_token_ids) == 2


def test_backends_lists_capabilities_and_why_each_runs_here_or_not(capsys):
    code, out = run(capsys, "backends", "--device", "cpu", "--json")
    rows = {row["name"]: row for row in json.loads(out.out)}
    assert code == 0
    assert {"reference", "triton", "linear-state", "legacy-reference", "legacy-triton"} <= set(rows)
    reference = rows["reference"]
    assert reference["priority"] == {"cpu": 100, "cuda": 10}
    assert reference["reasons"] == [] and reference["automatic"]
    assert reference["batch_invariant"] and not reference["cuda_graphs"]
    assert rows["linear-state"]["layer_kinds"] == ["linear_state"]
    assert rows["legacy-reference"]["priority"] == {}  # chosen by name only
    code, out = run(capsys, "backends", "--device", "cpu")
    assert code == 0 and "legacy-reference" in out.out and "by name" in out.out


def test_models_lists_presets_shapes_and_architectures(capsys):
    code, out = run(capsys, "models", "--json")
    report = json.loads(out.out)
    presets = {row["name"]: row for row in report["presets"]}
    assert code == 0
    assert presets["tiny-hybrid"]["layer_kinds"] == "full x1, sliding 32 x2, chunked 64 x1"
    assert "gpt-oss-20b" in {row["name"] for row in report["real_shapes"]}
    assert "LlamaForCausalLM" in report["architectures"]
    hybrids = {"Mamba2ForCausalLM", "BambaForCausalLM", "NemotronHForCausalLM",
               "GraniteMoeHybridForCausalLM", "Qwen3NextForCausalLM"}  # fmt: skip
    assert hybrids <= set(report["architectures"])
    code, out = run(capsys, "models")
    assert code == 0 and "tiny-hybrid" in out.out and "LlamaForCausalLM" in out.out


def test_version(capsys):
    from importlib import metadata

    from unified_attn.cli import version

    code, out = run(capsys, "--version")
    assert code == 0 and out.out.strip() == f"unified-attn {version()}"
    try:
        expected = metadata.version("unified_attn")
    except metadata.PackageNotFoundError:  # a source tree on PYTHONPATH
        expected = "unknown (not installed"
    assert version().startswith(expected)


@pytest.mark.parametrize(
    "command, shown",
    [
        ("run", ["(default: 32)", "(default: tiny-llama)", "{float32,float16,bfloat16}"]),
        ("plan", ["(default: 64MiB)", "(default: tiny-llama)", "(default: 512)"]),
        ("check", ["(default: 1)", "(default: cpu)"]),
        ("migrate", ["(default: tiny-hybrid)", "{float32,float16,bfloat16}"]),
        ("backends", ["--device"]),
        ("models", ["--json"]),
    ],
)
def test_every_help_shows_defaults_and_choices(capsys, command, shown):
    code, out = run(capsys, command, "--help")
    text = " ".join(out.out.split())  # help wraps lines
    assert code == 0
    for fragment in shown:
        assert fragment in text


def test_plan_takes_the_dtype_serving_uses_on_its_device(capsys):
    for device, dtype in (("cpu", "float32"), ("cuda", "bfloat16")):
        code, out = run(capsys, "plan", "--model", "gemma2-9b", "--device", device,
                        "--kv-cache-memory", "8GiB", "--json")  # fmt: skip
        settings = json.loads(out.out)["settings"]
        assert code == 0 and (settings["dtype"], settings["device"]) == (dtype, device)
    code, out = run(capsys, "plan", "--model", "gemma2-9b", "--device", "cuda",
                    "--kv-cache-memory", "8GiB")  # fmt: skip
    assert code == 0 and "bfloat16 (on cuda)" in " ".join(out.out.split())


def test_run_shows_a_few_generated_outputs(capsys):
    code, out = run(capsys, "run", "--num-requests", "4", "--max-tokens", "3", "--json")
    samples = json.loads(out.out)["sample_outputs"]
    assert code == 0 and len(samples) == 3
    assert all(len(s["token_ids"]) == 3 and s["finish_reason"] for s in samples)
    code, out = run(capsys, "run", "--num-requests", "2", "--max-tokens", "3")
    assert code == 0 and "Generated (first requests)" in out.out and "req-1" in out.out


def test_tables_wrap_long_names_instead_of_cutting_them(capsys):
    """Captured output is not a terminal: 80 columns, where rich would cut cells with '…'."""
    code, out = run(capsys, "backends")
    assert code == 0 and "…" not in out.out
    code, out = run(capsys, "plan", "--model", "deepseek-v4-flash", "--kv-cache-memory", "8GiB")
    assert code == 0 and "…" not in out.out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is for CPU machines")
@pytest.mark.parametrize(
    "argv",
    [
        ["check", "triton", "--json"],
        ["migrate", "--legacy", "legacy-triton", "--native", "triton", "--small", "--json"],
    ],
)
def test_the_commands_run_triton_in_the_interpreter_without_being_told(argv):
    """A new user on a CPU machine does not know TRITON_INTERPRET: the command sets it before
    any kernel is imported (kernels pick interpreter or compiler when imported)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-m", "unified_attn.cli", *argv]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["ok"]
