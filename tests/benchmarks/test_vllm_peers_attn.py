"""`benchmarks/vllm_peers.py`'s paged attention part on a fake vLLM tree (no vLLM needed): the
attention op's `vllm.*` imports become shims (envs, logger, platform, KVQuantMode) or relative
imports, the lazy INT4 import stays inside its function, the copy imports; a tree without the
attention ops leaves the folder unwritten."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "vllm_peers.py"

FAKE_ATTN_OP = """import torch

import vllm.envs as envs
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.triton_utils import tl, triton
from vllm.v1.attention.ops.triton_attention_helpers import (
    apply_softcap,
    cdiv_fn,
)
from vllm.v1.kv_cache_interface import KVQuantMode

logger = init_logger(__name__)
is_batch_invariant = envs.VLLM_BATCH_INVARIANT
float8_info = torch.finfo(current_platform.fp8_dtype())


def unified_attention(kv_quant_mode=KVQuantMode.NONE):
    if kv_quant_mode == KVQuantMode.INT4_PER_TOKEN_HEAD:
        from vllm.v1.attention.ops.int4_per_token_head import (
            unified_attention_int4,
        )

        return unified_attention_int4
    logger.debug_once("using 2D")
    tuned = current_platform.is_device_capability_family(100)
    return (apply_softcap, cdiv_fn, tl, triton, tuned, int(kv_quant_mode))
"""


def fake_tree(root: Path, bench, with_attn: bool = True) -> Path:
    ops = root / "src" / bench.OPS
    ops.mkdir(parents=True)
    for name in bench.MODULES:
        (ops / f"{name}.py").write_text("VALUE = 1\n")
    if with_attn:
        attn = root / "src" / bench.ATTN_OPS
        attn.mkdir(parents=True)
        (attn / "triton_unified_attention.py").write_text(FAKE_ATTN_OP)
        (attn / "triton_attention_helpers.py").write_text("apply_softcap = 1\ncdiv_fn = 2\n")
        (attn / "other_op.py").write_text("import vllm.not_shimmed\n")  # not copied
    return root / "src"


def test_installs_the_attention_op(bench, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    bench.main([str(fake_tree(tmp_path, bench)), "--dest", str(out / "m"), "--fla-dest",
                str(out / "f"), "--attn-dest", str(out / "fake_attn")])  # fmt: skip
    assert "fake_attn: 2 modules" in capsys.readouterr().out
    assert sorted(p.name for p in (out / "fake_attn").iterdir()) == [
        "__init__.py", "_shims.py", "triton_attention_helpers.py", "triton_unified_attention.py"
    ]  # fmt: skip
    text = (out / "fake_attn" / "triton_unified_attention.py").read_text()
    assert "vllm" not in text
    assert "        from .int4_per_token_head import (" in text
    assert "from .triton_attention_helpers import (" in text
    monkeypatch.syspath_prepend(str(out))
    try:
        module = importlib.import_module("fake_attn.triton_unified_attention")
        assert module.is_batch_invariant is False and module.float8_info.max == 448.0
        assert module.unified_attention()[:2] == (1, 2)
        assert module.unified_attention()[-1] == 0 and module.KVQuantMode.FP8_PER_TENSOR == 1
    finally:
        for name in [n for n in sys.modules if n.startswith("fake_attn")]:
            sys.modules.pop(name)


def test_a_tree_without_the_attention_ops_leaves_the_folder_alone(bench, tmp_path, capsys):
    source = fake_tree(tmp_path, bench, with_attn=False)
    attn_dest = tmp_path / "attn"
    bench.main([str(source), "--dest", str(tmp_path / "m"), "--fla-dest", str(tmp_path / "f"),
                "--attn-dest", str(attn_dest)])  # fmt: skip
    assert "not written" in capsys.readouterr().out
    assert not attn_dest.exists()
