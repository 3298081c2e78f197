"""`benchmarks/vllm_peers.py` on a fake vLLM tree (no vLLM needed): every `vllm.*` import of the
copied ops becomes a relative import or a shim, and the result imports."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "vllm_peers.py"

FAKE_OP = """from vllm.triton_utils import tl, triton
from vllm.platforms import current_platform
from vllm.v1.attention.backends.utils import (
    NULL_BLOCK_ID,
    PAD_SLOT_ID,
)
import vllm.envs as envs
from vllm.model_executor.layers.mamba.ops.triton_helpers import fast_exp

if current_platform.is_cpu():
    import vllm.model_executor.layers.mamba.ops.cpu.mamba_ssm as cpu_mamba_ssm

VALUES = (NULL_BLOCK_ID, PAD_SLOT_ID, envs.VLLM_TUNED_CONFIG_FOLDER, fast_exp, tl, triton)
"""


def test_help(bench, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    assert "--dest" in capsys.readouterr().out


def test_installs_rewritten_peers_that_import(bench, tmp_path, monkeypatch):
    ops = tmp_path / "src" / bench.OPS
    ops.mkdir(parents=True)
    for name in bench.MODULES:
        (ops / f"{name}.py").write_text("fast_exp = 1\n" if name == "triton_helpers" else FAKE_OP)
    dest = tmp_path / "out" / "fake_vllm_mamba"
    bench.main([str(tmp_path / "src"), "--dest", str(dest)])
    text = (dest / "ssd_bmm.py").read_text()
    assert "vllm" not in text.replace("vllm_", "")
    assert "from .triton_helpers import fast_exp" in text
    monkeypatch.syspath_prepend(str(dest.parent))
    module = importlib.import_module("fake_vllm_mamba.ssd_bmm")
    assert module.VALUES[:3] == (0, -1, None)
    sys.modules.pop("fake_vllm_mamba.ssd_bmm", None)
    sys.modules.pop("fake_vllm_mamba", None)


def test_refuses_a_tree_without_the_ops(bench, tmp_path):
    with pytest.raises(SystemExit, match="no vllm/model_executor"):
        bench.main([str(tmp_path)])
