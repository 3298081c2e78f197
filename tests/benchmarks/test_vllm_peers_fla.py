"""`benchmarks/vllm_peers.py`'s fla part on a fake vLLM tree (no vLLM needed): the fla ops'
`vllm.*` imports become shims, their relative imports stay, the copies import; a tree without
fla ops leaves the fla folder unwritten."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "vllm_peers.py"

FAKE_FLA_OP = """import torch

from vllm.platforms import current_platform
from vllm.triton_utils import tl, tldevice, triton
from vllm.utils.gpu_sync_debug import gpu_sync_allowed
from vllm.utils.torch_utils import async_tensor_h2d

from .utils import FLA_CHUNK_SIZE

if current_platform.is_rocm():
    from vllm.platforms.rocm import on_gfx1x

with gpu_sync_allowed():
    INDICES = async_tensor_h2d([1, 2], device="cpu", dtype=torch.int32)
VALUES = (FLA_CHUNK_SIZE, tl, tldevice, triton, current_platform.is_cuda_alike())
"""


def fake_tree(root: Path, bench) -> Path:
    ops = root / "src" / bench.OPS
    ops.mkdir(parents=True)
    for name in bench.MODULES:
        (ops / f"{name}.py").write_text("VALUE = 1\n")
    fla = root / "src" / bench.FLA_OPS
    fla.mkdir(parents=True)
    for name in bench.FLA_MODULES:
        (fla / f"{name}.py").write_text("FLA_CHUNK_SIZE = 64\n" if name == "utils" else FAKE_FLA_OP)
    return root / "src"


def test_installs_the_fla_ops_beside_the_mamba_ones(bench, tmp_path, monkeypatch, capsys):
    source = fake_tree(tmp_path, bench)
    out = tmp_path / "out"
    bench.main([str(source), "--dest", str(out / "m"), "--fla-dest", str(out / "fake_fla")])
    assert "12 modules" in capsys.readouterr().out
    text = (out / "fake_fla" / "chunk.py").read_text()
    assert "vllm" not in text and "    from ._shims import on_gfx1x" in text
    monkeypatch.syspath_prepend(str(out))
    try:
        module = importlib.import_module("fake_fla.chunk")
        assert module.VALUES[0] == 64 and module.INDICES.tolist() == [1, 2]
    finally:
        for name in [n for n in sys.modules if n.startswith("fake_fla")]:
            sys.modules.pop(name)


def test_a_tree_without_fla_ops_leaves_the_folder_alone(bench, tmp_path, capsys):
    source = fake_tree(tmp_path, bench)
    for path in (source / bench.FLA_OPS).iterdir():
        path.unlink()
    (source / bench.FLA_OPS).rmdir()
    fla_dest = tmp_path / "fla"
    bench.main([str(source), "--dest", str(tmp_path / "m"), "--fla-dest", str(fla_dest)])
    assert "not written" in capsys.readouterr().out
    assert not fla_dest.exists()
