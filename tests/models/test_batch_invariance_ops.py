"""The batch-invariant ops (`unified_attn.models.invariant`): a row's result is bitwise the same
whatever the number of rows around it and wherever it sits among them, and close to torch's.

CPU paths over M = 1..300; the Triton kernels in the interpreter on small shapes (float32 and
float16: the interpreter computes bfloat16 wrongly), with K not a multiple of BLOCK_K.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from unified_attn.kernels.invariant import invariant_launch as triton_ops
from unified_attn.models.invariant import (
    elementwise,
    invariant_linear,
    invariant_matmul,
    l2_normalize,
    layer_norm,
    log_softmax,
    rms_norm,
    sigmoid,
    softmax,
)
from unified_attn.models.layers import RMSNorm

ALL_M = range(1, 301)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rows_in_every_batch(fn, x: torch.Tensor, counts) -> list[int]:
    """The batch sizes M for which row 0 of `fn(x[:M])` differs from `fn(x[:1])`."""
    alone = fn(x[:1])[0]
    return [m for m in counts if not torch.equal(fn(x[:m])[0], alone)]


def rows_at_every_position(fn, x: torch.Tensor, others: torch.Tensor, sizes) -> list[int]:
    """The batch sizes for which `x[0]`, placed last after `others`, gets other bits."""
    alone = fn(x[:1])[0]
    return [m for m in sizes if not torch.equal(fn(torch.cat([others[: m - 1], x[:1]]))[-1], alone)]


# ---- matmul ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "k", "n", "counts"),
    [
        (torch.float32, 100, 77, ALL_M),  # K not a multiple of any block
        (torch.float32, 128, 384, range(1, 301, 7)),
        (torch.float16, 100, 77, range(1, 301, 23)),
        (torch.bfloat16, 128, 384, range(1, 301, 23)),
    ],
)
def test_cpu_linear_rows_do_not_depend_on_the_batch(dtype, k, n, counts):
    weight = torch.randn(n, k, generator=gen(0)).to(dtype)
    bias = torch.randn(n, generator=gen(1)).to(dtype)
    x = torch.randn(300, k, generator=gen(2)).to(dtype)

    def fn(rows):
        return invariant_linear(rows, weight, bias)

    assert rows_in_every_batch(fn, x, counts) == []
    others = torch.randn(120, k, generator=gen(3)).to(dtype)
    assert rows_at_every_position(fn, x, others, [2, 3, 4, 5, 8, 17, 33, 120]) == []
    expected = F.linear(x.double(), weight.double(), bias.double())
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(fn(x).double(), expected, rtol=tol, atol=tol * k**0.5)


def test_cpu_torch_linear_is_not_batch_invariant_the_reason_for_the_op():
    """The premise, measured: MKL's `F.linear` rounds a row differently with 1, 2-3 or 4+
    rows. If this fails, torch became invariant here and the CPU op is merely safe."""
    weight = torch.randn(384, 128, generator=gen(0))
    x = torch.randn(300, 128, generator=gen(1))
    assert rows_in_every_batch(lambda rows: F.linear(rows, weight), x, ALL_M) != []


def test_matmul_takes_any_weight_strides():
    """Experts' weights are `[K, N]` slices of `[E, K, N]`; a linear's `[N, K]` is read
    transposed."""
    w = torch.randn(3, 40, 24, generator=gen(0))
    x = torch.randn(9, 40, generator=gen(1))
    torch.testing.assert_close(invariant_matmul(x, w[1]), x @ w[1])
    torch.testing.assert_close(invariant_matmul(x, w[1, :, ::2]), x @ w[1, :, ::2])
    torch.testing.assert_close(invariant_linear(x[None], w[2].t()), (x @ w[2])[None])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_matmul_rows_do_not_depend_on_the_batch(dtype):
    k, n = 70, 40  # K: 2 full blocks of 32 and a partial one
    cfg = triton_ops.matmul_config(n, k, dtype)
    assert k % cfg.block_k
    weight = torch.randn(n, k, generator=gen(0)).to(dtype)
    bias = torch.randn(n, generator=gen(1)).to(dtype)
    x = torch.randn(2 * cfg.block_m + 3, k, generator=gen(2)).to(dtype)

    def fn(rows):
        return triton_ops.matmul(rows, weight.t(), bias)

    sizes = [1, 2, 3, cfg.block_m - 1, cfg.block_m, cfg.block_m + 1, len(x)]
    assert rows_in_every_batch(fn, x, sizes) == []
    assert rows_at_every_position(fn, x, x[1:], [2, cfg.block_m + 5]) == []
    expected = F.linear(x.double(), weight.double(), bias.double())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(fn(x).double(), expected, rtol=tol, atol=tol * k**0.5)


def test_matmul_reduction_is_chosen_without_the_row_count():
    """Only the output tile follows M; the K step (and so each element's reduction) does not.
    tests/gpu checks on Hopper that both tiles give the same bits."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for n, k in [(2048, 2048), (32000, 2048), (512, 8192), (40, 70)]:
            configs = {triton_ops.matmul_config(n, k, dtype, m) for m in (1, 64, 1023, 1024, 8192)}
            assert len({c.block_k for c in configs}) == 1
            assert len(configs) <= 2
    assert triton_ops.matmul_config(2048, 2048, torch.bfloat16).block_m == 64
    assert triton_ops.matmul_config(2048, 2048, torch.bfloat16, 8192).block_m == 128


def test_triton_matmul_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match=r"x \[M, K\] and w \[K, N\]"):
        triton_ops.matmul(torch.zeros(2, 3), torch.zeros(4, 5))


# ---- row-wise ops ----------------------------------------------------------------------------

WEIGHT = torch.randn(352, generator=gen(7)) * 0.1


def _rms(style):
    return lambda rows: rms_norm(rows, WEIGHT, 1e-6, style)


ROW_OPS = {
    "rms_llama": _rms("llama"),
    "rms_float32": _rms("float32"),
    "rms_gemma": _rms("gemma"),
    "layer_norm": lambda rows: layer_norm(rows, WEIGHT, WEIGHT, 1e-5),
    "l2_normalize": l2_normalize,
    "softmax": softmax,
    "log_softmax": log_softmax,
}


def _module_rms(style):
    def fn(rows):
        norm = RMSNorm(352, 1e-6, style)
        norm.weight.data.copy_(WEIGHT)
        return norm(rows)

    return fn


TORCH_OPS = {
    "rms_llama": _module_rms("llama"),
    "rms_float32": _module_rms("float32"),
    "rms_gemma": _module_rms("gemma"),
    "layer_norm": lambda rows: F.layer_norm(rows, (352,), WEIGHT, WEIGHT, 1e-5),
    "l2_normalize": lambda rows: F.normalize(rows, dim=-1),
    "softmax": lambda rows: torch.softmax(rows, dim=-1),
    "log_softmax": lambda rows: torch.log_softmax(rows, dim=-1),
}


@pytest.mark.parametrize("name", list(ROW_OPS))
def test_cpu_row_ops_do_not_depend_on_the_batch(name):
    x = torch.randn(300, 352, generator=gen(3)) * 2
    fn = ROW_OPS[name]
    counts = ALL_M if "softmax" not in name else range(1, 301, 11)  # softmax: row by row
    assert rows_in_every_batch(fn, x, counts) == []
    assert rows_at_every_position(fn, x, x[1:], [2, 3, 4, 5, 8, 17, 33, 120]) == []
    with torch.no_grad():
        torch.testing.assert_close(fn(x), TORCH_OPS[name](x), rtol=1e-5, atol=1e-5)


def test_cpu_elementwise_tail_rounds_differently_the_limit_of_the_cpu_path():
    """The CPU's documented limit, measured: torch's vectorised `silu` finishes a tensor with
    scalar code that rounds differently, so on rows of 7 floats a row's bits depend on where
    the batch puts it. Rows whose length is a multiple of 16 floats never reach that tail
    (`test_batch_invariance_model.py` checks every preset's widths)."""
    x = torch.randn(300, 7, generator=gen(3)) * 3
    assert rows_at_every_position(F.silu, x, x[1:], range(2, 301)) != []
    wide = torch.randn(300, 32, generator=gen(3)) * 3
    assert rows_at_every_position(F.silu, wide, wide[1:], range(2, 301)) == []


def test_cpu_sigmoid_of_a_narrow_gate_does_not_depend_on_the_batch():
    # Qwen2-MoE's shared-expert gate is `[T, 1]`: with torch alone, a row near the end of the
    # batch falls into the scalar tail, and its bits depend on the batch size
    x = torch.randn(300, 1, generator=gen(4)) * 3
    each = torch.cat([sigmoid(x[i : i + 1]) for i in range(300)])

    def batches_that_differ(fn) -> list[int]:
        return [m for m in ALL_M if not torch.equal(fn(x[:m]), each[:m])]

    assert batches_that_differ(torch.sigmoid) != []
    assert batches_that_differ(sigmoid) == []
    torch.testing.assert_close(each, torch.sigmoid(x), rtol=1e-6, atol=0)


@pytest.mark.parametrize("width", [16, 48, 7])
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_elementwise_activations_do_not_depend_on_the_batch(width, threads):
    # rows of 16 or 48 floats leave a partial AVX-512 step (32 floats) at the tensor's end for
    # odd row counts; `elementwise` pads the flat tensor to whole steps of every thread
    x = torch.randn(300, width, generator=gen(5)) * 3
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for fn in (F.silu, torch.sigmoid, lambda t: F.gelu(t, approximate="tanh")):
            each = torch.cat([elementwise(fn, x[i : i + 1]) for i in range(300)])
            assert [m for m in ALL_M if not torch.equal(elementwise(fn, x[:m]), each[:m])] == []
            torch.testing.assert_close(each, fn(x), rtol=1e-6, atol=1e-7)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(ROW_OPS))
def test_triton_row_ops_do_not_depend_on_the_batch_and_match_torch(name, dtype):
    weight = WEIGHT[:300].to(dtype)
    n = 300
    x = (torch.randn(9, n, generator=gen(4)) * 2).to(dtype)
    launch = {
        "rms_llama": lambda r: triton_ops.rms_norm(r, weight, 1e-6, "llama"),
        "rms_float32": lambda r: triton_ops.rms_norm(r, weight, 1e-6, "float32"),
        "rms_gemma": lambda r: triton_ops.rms_norm(r, weight, 1e-6, "gemma"),
        "layer_norm": lambda r: triton_ops.layer_norm(r, weight, weight, 1e-5),
        "l2_normalize": lambda r: triton_ops.l2_normalize(r, 1e-12),
        "softmax": lambda r: triton_ops.softmax(r),
        "log_softmax": lambda r: triton_ops.softmax(r, log=True),
    }[name]
    assert rows_in_every_batch(launch, x, [2, 9]) == []
    assert rows_at_every_position(launch, x, x[1:], [5]) == []
    reference = {
        "layer_norm": lambda r: F.layer_norm(r.float(), (n,), weight.float(), weight.float()),
        "l2_normalize": lambda r: F.normalize(r.float(), dim=-1),
        "softmax": lambda r: torch.softmax(r.float(), dim=-1),
        "log_softmax": lambda r: torch.log_softmax(r.float(), dim=-1),
    }
    if name.startswith("rms"):
        norm = RMSNorm(n, 1e-6, name.removeprefix("rms_")).to(dtype)
        norm.weight.data.copy_(weight)
        expected = norm(x).float().detach()
    else:
        expected = reference[name](x)
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(launch(x).float(), expected, rtol=tol, atol=tol)


def test_triton_rows_longer_than_a_block_loop_in_order():
    x = torch.randn(3, triton_ops.ROW_BLOCK_MAX * 2 + 17, generator=gen(5))
    torch.testing.assert_close(triton_ops.softmax(x), torch.softmax(x, dim=-1))
    torch.testing.assert_close(
        triton_ops.l2_normalize(x, 1e-12), F.normalize(x, dim=-1), rtol=1e-5, atol=1e-6
    )
