"""A backend written from scratch by following docs/porting-a-backend.md, as a framework developer
would in their own package: capabilities in `validate_configuration` (decoder layers, full or
sliding-window attention, float dtypes), the default `get_cache_config` (paged K/V under the
full or sliding-window manager), a frozen plan built in `prep_forward`, and `forward` writing
the step's keys and values and attending per request in plain torch. `unified-attn check` must
pass it (tests/harness/test_manager_conformance.py)."""

from __future__ import annotations

import attrs
import torch

from unified_attn import AttentionBackend
from unified_attn.backend import AttentionType


@attrs.frozen
class ScratchPlan:
    """One step: per request its query rows and how many keys it has (host); per KV-cache group
    the block table rows and the step's slots (device)."""

    requests: tuple[tuple[int, int, int], ...]  # (first query row, end row, keys after the step)
    tables: dict[int, torch.Tensor]  # group id -> [num_reqs, max_blocks] int32
    slots: dict[int, torch.Tensor]  # group id -> [num_tokens] int64


class ScratchBackend(AttentionBackend[ScratchPlan]):
    name = "scratch"

    @classmethod
    def validate_configuration(cls, cfg):
        reasons = []
        if cfg.attn_type != AttentionType.DECODER:
            reasons.append(f"serves decoder layers, not {cfg.attn_type.value}")
        if cfg.attention_chunk_size is not None:
            reasons.append("chunked local attention is not supported")
        if cfg.has_sinks:
            reasons.append("learned sinks are not supported")
        if cfg.num_sink_tokens:
            reasons.append("StreamingLLM sink tokens are not supported")
        if cfg.logits_soft_cap is not None:
            reasons.append("a logits soft cap is not supported")
        if cfg.kv_cache_dtype not in ("auto", cfg.dtype):
            reasons.append("the KV cache must be in the model dtype")
        return reasons

    def prep_forward(self, common, block_tables, for_cudagraph_capture=False):
        starts = common.query_start_loc_cpu.tolist()
        seq_lens = common.seq_lens_cpu.tolist()
        requests = tuple(
            (starts[i], starts[i + 1], seq_lens[i]) for i in range(common.num_reqs)
        )
        slots = {gid: common.slot_mappings[gid] for gid in block_tables}
        self.plan = ScratchPlan(requests, dict(block_tables), slots)

    def forward(self, layer, output, query, key, value, **kwargs):
        q, k, v = self.check_forward_inputs(layer, output, query, key, value)
        plan = self.current_plan()
        gid = self.group_of_layer[layer.name]
        cache = self.kv_caches[layer.name]  # [num_blocks, 2, block_size, kv_heads, head_size]
        block_size = cache.shape[2]
        slots = plan.slots[gid][: q.shape[0]]
        written = slots >= 0
        cache[slots[written] // block_size, 0, slots[written] % block_size] = k[written]
        cache[slots[written] // block_size, 1, slots[written] % block_size] = v[written]
        out = output.view(q.shape)
        for i, (start, end, num_keys) in enumerate(plan.requests):
            out[start:end] = self.attend(layer, q[start:end], cache, plan.tables[gid][i], num_keys)
        return output

    def attend(self, layer, q, cache, table, num_keys):
        """One request's queries (the last `len(q)` positions) over its cached keys."""
        block_size, window = cache.shape[2], layer.sliding_window
        query_pos = torch.arange(num_keys - q.shape[0], num_keys, device=q.device)
        first = 0 if window is None else max(0, num_keys - q.shape[0] - window + 1)
        key_pos = torch.arange(first, num_keys, device=q.device)  # blocks still held
        blocks, offsets = table[key_pos // block_size].long(), key_pos % block_size
        keys = cache[blocks, 0, offsets].float()  # [S, kv_heads, D]
        values = cache[blocks, 1, offsets].float()
        groups = q.shape[1] // keys.shape[1]
        keys = keys.repeat_interleave(groups, dim=1)
        values = values.repeat_interleave(groups, dim=1)
        scores = torch.einsum("thd,shd->hts", q.float(), keys) * layer.scale
        allowed = key_pos[None, :] <= query_pos[:, None]
        if window is not None:
            allowed &= key_pos[None, :] > query_pos[:, None] - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        return torch.einsum("hts,shd->thd", scores.softmax(-1), values).to(q.dtype)
