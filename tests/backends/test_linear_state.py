"""The gated-linear-attention state backend: chunkwise math against the plain recurrence, and
state carried through KV-cache state blocks across chunked prefill, decode and prefix hits."""

import pytest
import torch

from unified_attn.backend import CommonAttentionMetadata, LayerConfig
from unified_attn.backends.linear_state import LinearStateBackend, gated_linear_attention
from unified_attn.managers import KVCacheManager, SchedulerKVCacheConfig
from unified_attn.request import Request

H, D, BS = 2, 8, 8


def recurrence(q, k, v, log_gate, scale):
    """Token by token: S = g S + k^T v; o = scale q S."""
    state = torch.zeros(q.shape[1], q.shape[2], q.shape[2])
    out = []
    for t in range(q.shape[0]):
        g = log_gate[t].exp()[:, None, None]
        state = g * state + k[t][:, :, None] * v[t][:, None, :]
        out.append(scale * torch.einsum("hd,hde->he", q[t], state))
    return torch.stack(out), state


def inputs(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, H, D, generator=gen) for _ in range(3))
    log_gate = torch.nn.functional.logsigmoid(torch.randn(n, H, generator=gen) + 2)
    return q, k, v, log_gate


def test_chunkwise_form_equals_the_recurrence():
    q, k, v, g = inputs(150)
    out, state = gated_linear_attention(q, k, v, g, torch.zeros(H, D, D), 0.5)
    ref_out, ref_state = recurrence(q, k, v, g, 0.5)
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, ref_state, atol=1e-4, rtol=1e-4)


class StateHarness:
    """A KV-cache manager, a bound backend and hand-built metadata for single requests."""

    def __init__(self, mode):
        self.backend = LinearStateBackend(num_heads=H, head_size=D, dtype="float32",
                                          mamba_cache_mode=mode)  # fmt: skip
        manager_cls, config, spec = self.backend.get_cache_config()
        self.kv = KVCacheManager(SchedulerKVCacheConfig(32, BS, [(manager_cls, config)]), 512)
        page = spec.page_size_bytes(BS)
        self.buffer = torch.zeros(32 * page, dtype=torch.uint8)
        self.backend.bind_kv_caches({"l": spec.make_view(self.buffer, 0, page, 32, BS)}, {"l": 0})
        self.layer = LayerConfig("l", H, H, D, scale=0.5)

    def step(self, request, num_new, hits=None, num_hit=0):
        self.kv.new_step_starts()
        assert self.kv.allocate_slots(request, num_new, num_hit, hits) is not None
        request.num_computed_tokens += num_hit
        start = request.num_computed_tokens
        table = torch.tensor([self.kv.get_block_ids(request)[0]], dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=torch.tensor([0, num_new], dtype=torch.int32),
            query_start_loc_cpu=torch.tensor([0, num_new], dtype=torch.int32),
            seq_lens=torch.tensor([start + num_new], dtype=torch.int32),
            seq_lens_cpu=torch.tensor([start + num_new], dtype=torch.int32),
            num_computed_tokens_cpu=torch.tensor([start], dtype=torch.int32),
            positions=torch.arange(start, start + num_new),
            num_reqs=1, num_actual_tokens=num_new, max_query_len=num_new,
            max_seq_len=start + num_new, slot_mappings={0: torch.full((num_new,), -1)},
            block_sizes={0: BS},
        )  # fmt: skip
        self.backend.prep_forward(common, {0: table})
        request.num_computed_tokens += num_new
        return common

    def run(self, request, data, chunks):
        q, k, v, g = data
        outs = []
        for a, b in chunks:
            self.step(request, b - a)
            out = torch.empty(b - a, H * D)
            self.backend.forward(self.layer, out, q[a:b].flatten(1), k[a:b].flatten(1),
                                 v[a:b].flatten(1), log_gate=g[a:b])  # fmt: skip
            outs.append(out)
        return torch.cat(outs).view(-1, H, D)


@pytest.mark.parametrize("mode", ["none", "align"])
def test_chunked_prefill_and_decode_carry_the_state_through_blocks(mode):
    harness = StateHarness(mode)
    data = inputs(45)
    request = Request("r", list(range(45)), block_hasher=harness.kv.make_block_hasher())
    chunks = [(0, 13), (13, 32), *[(t, t + 1) for t in range(32, 45)]]
    out = harness.run(request, data, chunks)
    torch.testing.assert_close(out, recurrence(*data, 0.5)[0], atol=1e-4, rtol=1e-4)


def test_align_mode_prefix_hit_restores_the_checkpointed_state():
    harness = StateHarness("align")
    data = inputs(40)
    tokens = list(range(40))
    first = Request("a", tokens, block_hasher=harness.kv.make_block_hasher())
    harness.run(first, data, [(0, 16), (16, 24), (24, 40)])  # checkpoints at 16, 24, 40
    harness.kv.free(first)
    second = Request("b", tokens[:30], block_hasher=harness.kv.make_block_hasher())
    hits, num_hit = harness.kv.get_computed_blocks(second)
    assert num_hit == 24
    harness.step(second, 6, hits, num_hit)
    q, k, v, g = data
    out = torch.empty(6, H * D)
    harness.backend.forward(harness.layer, out, q[24:30].flatten(1), k[24:30].flatten(1),
                            v[24:30].flatten(1), log_gate=g[24:30])  # fmt: skip
    expected = recurrence(*(t[:30] for t in data), 0.5)[0][24:]
    torch.testing.assert_close(out.view(6, H, D), expected, atol=1e-4, rtol=1e-4)
