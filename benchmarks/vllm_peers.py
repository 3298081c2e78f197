"""Set up vLLM's Mamba-2 Triton kernels as same-run peers of `benchmarks/ssm_kernels.py`.

    python benchmarks/vllm_peers.py SOURCE [--dest benchmarks/peers/vllm_mamba]

SOURCE is a vLLM wheel (`pip download vllm==0.33.0 --no-deps -d DIR`) or a directory holding
its extracted `vllm/` package. The script copies `model_executor/layers/mamba/ops/`'s
`ssd_{bmm,chunk_scan,chunk_state,combined,state_passing}.py`, `mamba_ssm.py`,
`causal_conv1d.py` and `triton_helpers.py` (plus the tuned `configs/selective_state_update`
JSON files when the source has them) into DEST, a folder git ignores, and rewrites their
`vllm.*` imports: the ops' own modules become relative imports, everything else comes from a
small `_shims.py` written beside them (triton, the CUDA platform queries the kernels ask,
NULL_BLOCK_ID = 0, PAD_SLOT_ID = -1, a logger). Nothing of vLLM is committed; the GPU machine
has no internet, so DEST travels with the run (`carry`).
"""

from __future__ import annotations

import argparse
import re
import shutil
import zipfile
from collections.abc import Sequence
from pathlib import Path

OPS = "vllm/model_executor/layers/mamba/ops"
MODULES = (
    "ssd_bmm", "ssd_chunk_scan", "ssd_chunk_state", "ssd_combined", "ssd_state_passing",
    "mamba_ssm", "causal_conv1d", "triton_helpers",
)  # fmt: skip
CONFIGS = "configs/selective_state_update"
DEFAULT_DEST = Path(__file__).resolve().parent / "peers" / "vllm_mamba"

SHIMS = '''"""What vLLM's Mamba ops import from the rest of vLLM, for a CUDA machine
(written by benchmarks/vllm_peers.py)."""

import logging

import torch
import triton
import triton.language as tl

HAS_TRITON = True
NULL_BLOCK_ID = 0
PAD_SLOT_ID = -1


class _Platform:
    def is_cpu(self): return False
    def is_xpu(self): return False
    def is_rocm(self): return False
    def is_cuda(self): return torch.cuda.is_available()

    def is_device_capability(self, capability):
        if not torch.cuda.is_available():
            return False
        major, minor = torch.cuda.get_device_capability()
        return major * 10 + minor == capability

    def is_arch_support_pdl(self):
        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9

    def get_device_name(self, device_id=0):
        return torch.cuda.get_device_name(device_id)


current_platform = _Platform()


class envs:
    VLLM_TUNED_CONFIG_FOLDER = None


class _custom_ops:
    """The CUDA selective-scan op is not part of the peers."""


def get_device_name_as_file_name(device_id=0):
    import re

    return re.sub(r"[\\s/]+", "_", current_platform.get_device_name(device_id))


class _Logger(logging.LoggerAdapter):
    def info_once(self, msg, *args, **kwargs):
        self.info(msg, *args)

    def warning_once(self, msg, *args, **kwargs):
        self.warning(msg, *args)


def init_logger(name):
    return _Logger(logging.getLogger(name), {})
'''

# `from vllm.x.y import (a, b)` or `import vllm.x as y`, possibly over several lines
IMPORT = re.compile(r"^(\s*)(from\s+vllm(?:\.[\w.]+)?\s+import\s+(?:\([^)]*\)|[^\n]*)|"
                    r"import\s+vllm\.[\w.]+\s+as\s+\w+)", re.M)  # fmt: skip


def rewrite_import(match: re.Match[str]) -> str:
    indent, statement = match.group(1), match.group(2)
    own = re.match(rf"from\s+{OPS.replace('/', '.')}\.(\w+)\s+import", statement)
    if own:
        return indent + statement.replace(own.group(0), f"from .{own.group(1)} import", 1)
    if statement.startswith("import"):  # `import vllm.envs as envs`, the CPU fallbacks
        alias = statement.split()[-1]
        return f"{indent}from ._shims import {'envs' if alias == 'envs' else '_custom_ops'}" + (
            "" if alias == "envs" else f" as {alias}"
        )
    names = statement.split("import", 1)[1]
    return f"{indent}from ._shims import{names}"


def rewrite(source: str) -> str:
    text = IMPORT.sub(rewrite_import, source)
    leftover = re.findall(r"^\s*(?:from|import)\s+vllm\b.*$", text, re.M)
    if leftover:
        raise SystemExit(f"unrewritten vLLM imports: {leftover}")
    return text


def read_sources(source: Path) -> dict[str, bytes]:
    """`relative path under ops/` -> bytes, from a wheel or an extracted tree."""
    wanted = [f"{name}.py" for name in MODULES]
    if source.is_file():
        with zipfile.ZipFile(source) as wheel:
            names = {n[len(OPS) + 1 :]: n for n in wheel.namelist() if n.startswith(f"{OPS}/")}
            return {rel: wheel.read(full) for rel, full in names.items()
                    if rel in wanted or rel.startswith(f"{CONFIGS}/")}  # fmt: skip
    root = source / OPS if (source / OPS).is_dir() else source / "src" / OPS
    if not root.is_dir():
        raise SystemExit(f"{source}: no {OPS} inside; pass a vLLM wheel or its extracted tree")
    files = {name: (root / name).read_bytes() for name in wanted}
    for path in sorted((root / CONFIGS).glob("*.json")):
        files[f"{CONFIGS}/{path.name}"] = path.read_bytes()
    return files


def install(source: Path, dest: Path) -> list[str]:
    files = read_sources(source)
    missing = [m for m in MODULES if f"{m}.py" not in files]
    if missing:
        raise SystemExit(f"{source}: missing vLLM Mamba ops {missing}")
    if dest.exists():
        shutil.rmtree(dest)
    (dest / CONFIGS).mkdir(parents=True)
    (dest / "__init__.py").write_text('"""vLLM Mamba-2 Triton ops (peers; git ignored)."""\n')
    (dest / "_shims.py").write_text(SHIMS)
    for name, data in files.items():
        text = rewrite(data.decode()) if name.endswith(".py") else data.decode()
        (dest / name).write_text(text)
    return sorted(files)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("source", type=Path, help="vLLM wheel, or a directory with its vllm/")
    ap.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    args = ap.parse_args(argv)
    files = install(args.source, args.dest)
    configs = sum(name.endswith(".json") for name in files)
    print(f"{args.dest}: {len(files) - configs} modules, {configs} tuned configs")


if __name__ == "__main__":
    main()
