"""CUDA graphs for decode steps.

Decode batches (one new token per request) are padded up to a captured batch size and replayed.
Everything the graph reads lives in persistent buffers that each step overwrites in place:
token ids, positions, `query_start_loc`, `seq_lens`, per-group slot mappings and block tables.
Padding rows have sequence length 0 (the kernels skip them), slot -1 (nothing is written) and
block-table rows of the null block.
"""

from __future__ import annotations

from typing import Any

import torch

from unified_attn.backend import AttentionBackend, CommonAttentionMetadata


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to 64, then of 32, ending at `max_num_seqs`."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, min(64, max_num_seqs) + 1, 8))
    sizes += list(range(96, max_num_seqs + 1, 32))
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    """One captured graph per decode batch size (`capture_sizes`) over persistent buffers;
    `run` copies a step into the buffers, lets the backends plan on them, and replays."""

    def __init__(
        self,
        model: Any,
        backend_groups: list[tuple[AttentionBackend, list[int]]],
        table_widths: list[int],
        block_sizes: list[int],
        *,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.backend_groups = backend_groups
        self.max_model_len = max_model_len
        self.block_sizes = dict(enumerate(block_sizes))
        self.sizes = capture_sizes(max_num_seqs)
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.query_start_loc_cpu = torch.arange(n + 1, dtype=torch.int32)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.slots = [torch.full((n,), -1, dtype=torch.int64, device=device) for _ in table_widths]
        self.tables = [torch.zeros(n, w, dtype=torch.int32, device=device) for w in table_widths]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Per size, views of the persistent buffers: built once, reused every replay.
        self.commons: dict[int, CommonAttentionMetadata] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool: Any = None  # the graphs share one memory pool
        self.num_replays = 0

    def bucket(self, num_reqs: int) -> int | None:
        return next((s for s in self.sizes if s >= num_reqs), None)

    def _common(self, n: int) -> CommonAttentionMetadata:
        if n not in self.commons:
            self.commons[n] = self._make_common(n)
        return self.commons[n]

    def _make_common(self, n: int) -> CommonAttentionMetadata:
        return CommonAttentionMetadata(
            query_start_loc=self.query_start_loc[: n + 1],
            query_start_loc_cpu=self.query_start_loc_cpu[: n + 1],
            seq_lens=self.seq_lens[:n],
            seq_lens_cpu=torch.zeros(n, dtype=torch.int32),
            num_computed_tokens_cpu=torch.zeros(n, dtype=torch.int32),
            positions=self.positions[:n],
            num_reqs=n,
            num_actual_tokens=n,
            max_query_len=1,
            max_seq_len=self.max_model_len,  # the split-KV plan must cover any length
            slot_mappings={gid: s[:n] for gid, s in enumerate(self.slots)},
            block_sizes=self.block_sizes,
        )

    def _prep(self, n: int, capture: bool) -> None:
        common = self._common(n)
        for backend, gids in self.backend_groups:
            tables = {gid: self.tables[gid][:n] for gid in gids}
            backend.prep_forward(common, tables, for_cudagraph_capture=capture)

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest size first, so persistent scratch buffers are sized before any capture."""
        for n in reversed(self.sizes):
            self._prep(n, capture=True)
            self.model.compute_logits(self.model(self.input_ids[:n], self.positions[:n]))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                hidden = self.model(self.input_ids[:n], self.positions[:n])
                self.logits[n] = self.model.compute_logits(hidden)
            self.pool = graph.pool()
            self.graphs[n] = graph

    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,
        common: CommonAttentionMetadata,
        tables: dict[int, torch.Tensor],
    ) -> torch.Tensor:
        """Logits `[num_reqs, vocab]` of a decode step, by replaying the padded graph."""
        b = common.num_reqs
        n = self.bucket(b)
        assert n is not None, "decode batch larger than every captured size"
        self.input_ids[:b].copy_(input_ids, non_blocking=True)
        self.positions[:b].copy_(common.positions, non_blocking=True)
        self.seq_lens[:b].copy_(common.seq_lens, non_blocking=True)
        self.seq_lens[b:n].zero_()
        for gid, slots in enumerate(self.slots):
            slots[:b].copy_(common.slot_mappings[gid], non_blocking=True)
            slots[b:n].fill_(-1)
            table = tables[gid]
            self.tables[gid][:b, : table.shape[1]].copy_(table, non_blocking=True)
            self.tables[gid][b:n].zero_()
        self._prep(n, capture=False)
        self.graphs[n].replay()
        self.num_replays += 1
        return self.logits[n][:b]
