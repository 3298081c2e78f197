"""Run a `DecoderModel` over paged KV caches without the engine: prefill, then decode steps.

Every layer gets its own bytes inside a block (bytes_per_block = sum of all page sizes), so the
groups (one per backend instance) can share block ids: request i owns the consecutive blocks
`1 + i * blocks_per_req, ...` in every group; block 0 is the null block.
"""

from __future__ import annotations

import math

import torch

from unified_attn.backend import AttentionBackend, CommonAttentionMetadata
from unified_attn.models import DecoderModel


class PagedRunner:
    def __init__(
        self, model: DecoderModel, num_reqs: int, max_len: int, block_size: int = 4
    ) -> None:
        self.model, self.block_size = model, block_size
        blocks_per_req = math.ceil(max_len / block_size)
        num_blocks = 1 + num_reqs * blocks_per_req
        self.groups = self._bind(model, num_blocks, block_size)
        table = 1 + torch.arange(num_reqs * blocks_per_req, dtype=torch.int32)
        self.block_table = table.view(num_reqs, blocks_per_req).to(model.device)
        self.num_computed = [0] * num_reqs

    @staticmethod
    def _bind(
        model: DecoderModel, num_blocks: int, block_size: int
    ) -> list[tuple[AttentionBackend, int]]:
        layers = list(model.attention_layers())
        pages = [b.get_cache_config()[2].page_size_bytes(block_size) for _, b in layers]
        bytes_per_block = sum(pages)
        buffer = torch.zeros(num_blocks * bytes_per_block, dtype=torch.uint8, device=model.device)
        backends = list(model.backends.values())
        views: dict[int, dict[str, torch.Tensor]] = {id(b): {} for b in backends}
        offset = 0
        for (layer, backend), page in zip(layers, pages, strict=True):
            spec = backend.get_cache_config()[2]
            view = spec.make_view(buffer, offset, bytes_per_block, num_blocks, block_size)
            views[id(backend)][layer.name] = view
            offset += page
        for gid, backend in enumerate(backends):
            backend.bind_kv_caches(views[id(backend)], dict.fromkeys(views[id(backend)], gid))
        return [(backend, gid) for gid, backend in enumerate(backends)]

    def step(self, tokens: list[list[int]]) -> torch.Tensor:
        """Feed the next tokens of every request; logits `[T, vocab]` of all fed tokens."""
        common = self._metadata([len(t) for t in tokens])
        for backend, gid in self.groups:
            backend.prep_forward(common, {gid: self.block_table})
        input_ids = torch.tensor([t for req in tokens for t in req], device=self.model.device)
        hidden = self.model(input_ids, common.positions)
        self.num_computed = [c + len(t) for c, t in zip(self.num_computed, tokens, strict=True)]
        return self.model.compute_logits(hidden)

    def _metadata(self, query_lens: list[int]) -> CommonAttentionMetadata:
        device = self.model.device
        computed = torch.tensor(self.num_computed, dtype=torch.int32)
        seq_lens = computed + torch.tensor(query_lens, dtype=torch.int32)
        qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)
        positions = torch.cat(
            [torch.arange(c, s) for c, s in zip(computed.tolist(), seq_lens.tolist(), strict=True)]
        )
        req = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
        block_ids = self.block_table.cpu()[req, positions // self.block_size].long()
        slots = block_ids * self.block_size + positions % self.block_size
        return CommonAttentionMetadata(
            query_start_loc=qsl.to(device),
            query_start_loc_cpu=qsl,
            seq_lens=seq_lens.to(device),
            seq_lens_cpu=seq_lens,
            num_computed_tokens_cpu=computed,
            positions=positions.to(device),
            num_reqs=len(query_lens),
            num_actual_tokens=int(qsl[-1]),
            max_query_len=max(query_lens),
            max_seq_len=int(seq_lens.max()),
            slot_mappings={gid: slots.to(device) for _, gid in self.groups},
        )


def prefill_logits(
    model: DecoderModel, prompts: list[list[int]], block_size: int = 4
) -> list[torch.Tensor]:
    """All prompts in ONE prefill step; per prompt its logits `[len, vocab]`."""
    runner = PagedRunner(model, len(prompts), max(map(len, prompts)), block_size)
    logits = runner.step(prompts)
    return list(logits.split([len(p) for p in prompts]))


def greedy_decode(
    model: DecoderModel, prompts: list[list[int]], num_tokens: int, block_size: int = 4
) -> list[list[int]]:
    """Prefill, then `num_tokens - 1` decode steps feeding back the argmax; the new tokens."""
    runner = PagedRunner(model, len(prompts), max(map(len, prompts)) + num_tokens, block_size)
    logits = runner.step(prompts)
    last = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    out = [[t] for t in logits[last].argmax(-1).tolist()]
    for _ in range(num_tokens - 1):
        step_logits = runner.step([seq[-1:] for seq in out])
        for seq, t in zip(out, step_logits.argmax(-1).tolist(), strict=True):
            seq.append(t)
    return out
