"""Set up vLLM's Triton kernels as same-run peers: the Mamba-2 ops for
`benchmarks/ssm_kernels.py`, the fla (flash-linear-attention) gated delta rule ops for
`benchmarks/gated_delta_kernels.py`, the paged attention op for `benchmarks/decode_fixed_cost.py`.

    python benchmarks/vllm_peers.py SOURCE [--dest benchmarks/peers/vllm_mamba]
                                           [--fla-dest benchmarks/peers/vllm_fla]
                                           [--attn-dest benchmarks/peers/vllm_attn]

SOURCE is a vLLM wheel (`pip download vllm==0.33.0 --no-deps -d DIR`) or a directory holding
its extracted `vllm/` package. The script copies `model_executor/layers/mamba/ops/`'s
`ssd_{bmm,chunk_scan,chunk_state,combined,state_passing}.py`, `mamba_ssm.py`,
`causal_conv1d.py` and `triton_helpers.py` (plus the tuned `configs/selective_state_update`
JSON files when the source has them) into DEST, and `third_party/flash_linear_attention/ops/`'s
modules that `chunk_gated_delta_rule` and the recurrent decode kernels need (`FLA_MODULES`)
into FLA_DEST, and `v1/attention/ops/`'s `triton_unified_attention.py` (vLLM's Triton paged
attention, `unified_attention`) with `triton_attention_helpers.py` into ATTN_DEST (each of the
two skipped, with a note, when the source lacks them; the INT4 KV-cache path's lazy import of
`int4_per_token_head` is left dangling: the benchmarks run bf16 caches). The folders are git
ignored. Their `vllm.*` imports are rewritten: the ops' own modules become relative imports,
everything else comes from a small `_shims.py` written beside them (triton, the CUDA platform
queries the kernels ask, fp8 = e4m3fn, NULL_BLOCK_ID = 0, PAD_SLOT_ID = -1, `envs` with
VLLM_BATCH_INVARIANT off, `KVQuantMode`, a logger, no-op sync guards).
Nothing of vLLM is committed; the GPU machine has no internet, so the folders travel with the
run (`carry`).
"""

from __future__ import annotations

import argparse
import re
import shutil
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

OPS = "vllm/model_executor/layers/mamba/ops"
MODULES = (
    "ssd_bmm", "ssd_chunk_scan", "ssd_chunk_state", "ssd_combined", "ssd_state_passing",
    "mamba_ssm", "causal_conv1d", "triton_helpers",
)  # fmt: skip
CONFIGS = "configs/selective_state_update"
DEFAULT_DEST = Path(__file__).resolve().parent / "peers" / "vllm_mamba"
FLA_OPS = "vllm/third_party/flash_linear_attention/ops"
FLA_MODULES = (
    "chunk", "chunk_delta_h", "chunk_o", "chunk_scaled_dot_kkt", "cumsum", "index", "l2norm",
    "op", "solve_tril", "utils", "wy_fast", "fused_recurrent",
)  # fmt: skip
DEFAULT_FLA_DEST = Path(__file__).resolve().parent / "peers" / "vllm_fla"
ATTN_OPS = "vllm/v1/attention/ops"
ATTN_MODULES = ("triton_unified_attention", "triton_attention_helpers")
DEFAULT_ATTN_DEST = Path(__file__).resolve().parent / "peers" / "vllm_attn"


@dataclass(frozen=True)
class PeerSet:
    """vLLM ops copied as one peer package."""

    name: str  # for the package docstring and messages
    ops: str  # their folder inside the wheel
    modules: tuple[str, ...]
    configs: str | None = None  # a folder of tuned JSON files under `ops`, copied if present


MAMBA = PeerSet("Mamba-2", OPS, MODULES, CONFIGS)
FLA = PeerSet("fla gated delta rule", FLA_OPS, FLA_MODULES)
ATTN = PeerSet("paged attention", ATTN_OPS, ATTN_MODULES)

SHIMS = '''"""What vLLM's Mamba-2, fla and paged attention ops import from the rest of vLLM, for
a CUDA machine (written by benchmarks/vllm_peers.py)."""

import contextlib
import enum
import logging

import torch
import triton
import triton.language as tl
import triton.language.extra.libdevice as tldevice

HAS_TRITON = True
NULL_BLOCK_ID = 0
PAD_SLOT_ID = -1


class _Platform:
    def is_cpu(self): return False
    def is_xpu(self): return False
    def is_rocm(self): return False
    def is_cuda(self): return torch.cuda.is_available()
    def is_cuda_alike(self): return torch.cuda.is_available()

    def is_device_capability(self, capability):
        if not torch.cuda.is_available():
            return False
        major, minor = torch.cuda.get_device_capability()
        return major * 10 + minor == capability

    def is_device_capability_family(self, capability, device_id=0):
        if not torch.cuda.is_available():
            return False
        return torch.cuda.get_device_capability(device_id)[0] == capability // 10

    def is_arch_support_pdl(self):
        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9

    def get_device_name(self, device_id=0):
        return torch.cuda.get_device_name(device_id)

    def fp8_dtype(self):
        return torch.float8_e4m3fn


current_platform = _Platform()


class envs:
    VLLM_TUNED_CONFIG_FOLDER = None
    VLLM_BATCH_INVARIANT = False
    VLLM_TRITON_USE_TD = None


class KVQuantMode(enum.IntEnum):
    """The KV-cache quantization modes vLLM's paged attention op dispatches on."""

    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4


class _custom_ops:
    """The CUDA selective-scan op is not part of the peers."""


def on_gfx1x():
    return False


def gpu_sync_allowed(first_only=False):
    return contextlib.nullcontext()


def async_tensor_h2d(data, device=None, dtype=None, out=None):
    return torch.as_tensor(data, dtype=dtype).to(device)


def get_device_name_as_file_name(device_id=0):
    import re

    return re.sub(r"[\\s/]+", "_", current_platform.get_device_name(device_id))


class _Logger(logging.LoggerAdapter):
    def debug_once(self, msg, *args, **kwargs):
        self.debug(msg, *args)

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


def rewrite_import(match: re.Match[str], ops: str) -> str:
    indent, statement = match.group(1), match.group(2)
    own = re.match(rf"from\s+{ops.replace('/', '.')}\.(\w+)\s+import", statement)
    if own:
        return indent + statement.replace(own.group(0), f"from .{own.group(1)} import", 1)
    if statement.startswith("import"):  # `import vllm.envs as envs`, the CPU fallbacks
        alias = statement.split()[-1]
        return f"{indent}from ._shims import {'envs' if alias == 'envs' else '_custom_ops'}" + (
            "" if alias == "envs" else f" as {alias}"
        )
    names = statement.split("import", 1)[1]
    return f"{indent}from ._shims import{names}"


def rewrite(source: str, ops: str = OPS) -> str:
    text = IMPORT.sub(lambda match: rewrite_import(match, ops), source)
    leftover = re.findall(r"^\s*(?:from|import)\s+vllm\b.*$", text, re.M)
    if leftover:
        raise SystemExit(f"unrewritten vLLM imports: {leftover}")
    return text


def read_sources(source: Path, peers: PeerSet) -> dict[str, bytes]:
    """`relative path under ops/` -> bytes, from a wheel or an extracted tree ({}: no ops)."""
    wanted = {f"{name}.py" for name in peers.modules}
    configs = f"{peers.configs}/" if peers.configs else None
    if source.is_file():
        with zipfile.ZipFile(source) as wheel:
            names = {n[len(peers.ops) + 1 :]: n for n in wheel.namelist()
                     if n.startswith(f"{peers.ops}/")}  # fmt: skip
            return {rel: wheel.read(full) for rel, full in names.items()
                    if rel in wanted or (configs and rel.startswith(configs))}  # fmt: skip
    root = source / peers.ops if (source / peers.ops).is_dir() else source / "src" / peers.ops
    if not root.is_dir():
        return {}
    files = {name: (root / name).read_bytes() for name in wanted if (root / name).is_file()}
    for path in sorted((root / peers.configs).glob("*.json")) if peers.configs else ():
        files[f"{peers.configs}/{path.name}"] = path.read_bytes()
    return files


def install(source: Path, dest: Path, peers: PeerSet = MAMBA) -> list[str]:
    files = read_sources(source, peers)
    if not files:
        raise SystemExit(f"{source}: no {peers.ops} inside; pass a vLLM wheel or its extracted "
                         "tree")  # fmt: skip
    missing = [m for m in peers.modules if f"{m}.py" not in files]
    if missing:
        raise SystemExit(f"{source}: missing vLLM {peers.name} ops {missing}")
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    if peers.configs:
        (dest / peers.configs).mkdir(parents=True)
    (dest / "__init__.py").write_text(f'"""vLLM {peers.name} Triton ops (peers; git ignored)."""\n')
    (dest / "_shims.py").write_text(SHIMS)
    for name, data in files.items():
        text = rewrite(data.decode(), peers.ops) if name.endswith(".py") else data.decode()
        (dest / name).write_text(text)
    return sorted(files)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("source", type=Path, help="vLLM wheel, or a directory with its vllm/")
    ap.add_argument("--dest", type=Path, default=DEFAULT_DEST, help="the Mamba-2 peers' folder")
    ap.add_argument("--fla-dest", type=Path, default=DEFAULT_FLA_DEST,
                    help="the fla gated delta rule peers' folder")  # fmt: skip
    ap.add_argument("--attn-dest", type=Path, default=DEFAULT_ATTN_DEST,
                    help="the paged attention peers' folder")  # fmt: skip
    args = ap.parse_args(argv)
    files = install(args.source, args.dest)
    configs = sum(name.endswith(".json") for name in files)
    print(f"{args.dest}: {len(files) - configs} modules, {configs} tuned configs")
    if read_sources(args.source, FLA):
        print(f"{args.fla_dest}: {len(install(args.source, args.fla_dest, FLA))} modules")
    else:
        print(f"{args.source}: no {FLA_OPS}; {args.fla_dest} not written")
    missing = sorted(set(ATTN_MODULES) - {Path(n).stem for n in read_sources(args.source, ATTN)})
    if missing:  # an older vLLM: its attention ops have other names
        print(f"{args.source}: no {ATTN_OPS}/{{{','.join(missing)}}}.py; {args.attn_dest} not "
              "written")  # fmt: skip
    else:
        print(f"{args.attn_dest}: {len(install(args.source, args.attn_dest, ATTN))} modules")


if __name__ == "__main__":
    main()
