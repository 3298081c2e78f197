"""DeepSeek-V4's layer attention on the reference backends: the `swa` user's partial merged with
another partial and the sinks (`merge_partials`), and `attend_row_sets`'s one softmax over several
users' rows and the sinks, against the dense softmax; its refusals."""

from __future__ import annotations

import pytest
import torch

from tests.backends.test_deepseek_v4_backend import (
    CHUNKS,
    F32,
    SEQ,
    Bound,
    dense_partial,
    layer,
    rows,
)
from unified_attn.backends.deepseek_v4_steps import GatheredRows, merge_partials
from unified_attn.backends.deepseek_v4_window import DeepseekV4WindowBackend


def window_case(seed: int, heads: int, dim: int, window: int):
    """A window backend bound to one `swa` layer, a generator, each request's latents and the
    sinks."""
    swa = DeepseekV4WindowBackend(head_size=dim, dtype=F32, sliding_window=window)
    bound = Bound(swa, [layer("swa", heads, dim, window)])
    gen = torch.Generator().manual_seed(seed)
    latents = [torch.randn(s, dim, generator=gen) for s in SEQ]
    return swa, bound, gen, latents, torch.randn(heads, generator=gen)


def test_window_and_compressed_partials_merge_into_one_softmax_with_sinks():
    heads, dim, window = 2, 8, 5
    swa, bound, gen, latents, sinks = window_case(4, heads, dim, window)
    for new in CHUNKS:
        before = list(bound.computed)
        common = bound.step(new)
        q = torch.randn(sum(new), heads, dim, generator=gen)
        kv = rows(new, latents, before)
        out, lse = torch.empty(q.shape[0], heads * dim), torch.empty(q.shape[0], heads)
        swa.forward(bound.layers[0], out, q, kv, kv, lse=lse)
        extra = torch.randn(q.shape[0], 3, dim, generator=gen)  # a second partial's keys
        extra_out, extra_lse = dense_partial(q, extra, torch.ones(q.shape[0], 3, dtype=bool), 0.5)
        merged = merge_partials([(out.view(q.shape), lse), (extra_out, extra_lse)], sinks)
        request = torch.repeat_interleave(torch.arange(2), torch.tensor(new))
        for t, (b, p) in enumerate(zip(request.tolist(), common.positions.tolist(), strict=True)):
            keys = torch.cat([latents[b][max(0, p - window + 1) : p + 1], extra[t]])
            logits = torch.cat([keys @ q[t].T * 0.5, sinks[None]])  # [S + 1, H]
            probs = logits.softmax(0)[:-1]
            assert torch.allclose(merged[t], probs.T @ keys, atol=1e-5)


def test_attend_row_sets_is_one_softmax_over_every_row_set_and_the_sinks():
    # The window's rows (gather_rows) and a second set from another cache, as the layer joins
    # them: the same result as the dense softmax over both key sets plus the sink logit.
    heads, dim, window = 2, 8, 5
    swa, bound, gen, latents, sinks = window_case(5, heads, dim, window)
    other = torch.randn(4, 3, dim, generator=gen)  # another user's cache: 4 blocks of 3 rows
    other[3] = float("nan")  # a block no visible row names: its bits never reach the output
    for new in CHUNKS:
        before = list(bound.computed)
        common = bound.step(new)
        n = sum(new)
        q = torch.randn(n, heads, dim, generator=gen)
        kv = rows(new, latents, before)
        window_rows = swa.gather_rows(bound.layers[0], q, kv)
        blocks = torch.randint(0, 3, (n, 4), generator=gen)
        offsets = torch.randint(0, 3, (n, 4), generator=gen)
        visible = torch.rand(n, 4, generator=gen) > 0.3
        blocks[:, -1], visible[:, -1] = 3, False  # the hidden NaN row
        extra = GatheredRows(other, blocks, offsets, visible)
        out = torch.full((n, heads * dim), float("nan"))
        swa.attend_row_sets(bound.layers[0], out, q, [window_rows, extra], sinks)
        request = torch.repeat_interleave(torch.arange(2), torch.tensor(new))
        for t, (b, p) in enumerate(zip(request.tolist(), common.positions.tolist(), strict=True)):
            seen = other[blocks[t], offsets[t]][visible[t]]
            keys = torch.cat([latents[b][max(0, p - window + 1) : p + 1], seen])
            logits = torch.cat([keys @ q[t].T * 0.5, sinks[None]])  # [S + 1, H]
            want = logits.softmax(0)[:-1].T @ keys
            assert torch.allclose(out[t].view(heads, dim), want, atol=1e-5)


def test_attend_row_sets_refuses_bad_row_sets_and_sinks():
    swa = DeepseekV4WindowBackend(head_size=8, dtype=F32, sliding_window=4)
    bound = Bound(swa, [layer("swa", 2, 8, 4)])
    bound.step([4, 4])
    q, out = torch.zeros(8, 2, 8), torch.zeros(8, 16)
    rows_ = swa.gather_rows(bound.layers[0], q, torch.zeros(8, 8))
    name = r"layer model\.layers\.0\.self_attn\.swa: "
    with pytest.raises(ValueError, match=name + "attend_row_sets needs at least one row set"):
        swa.attend_row_sets(bound.layers[0], out, q, [], torch.zeros(2))
    with pytest.raises(ValueError, match=name + r"sinks has shape \(3,\), expected \(2,\)"):
        swa.attend_row_sets(bound.layers[0], out, q, [rows_], torch.zeros(3))
    with pytest.raises(ValueError, match=name + r"output has shape \(8, 8\)"):
        swa.attend_row_sets(bound.layers[0], out[:, :8], q, [rows_], torch.zeros(2))
