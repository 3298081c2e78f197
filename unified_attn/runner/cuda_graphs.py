"""CUDA graphs for decode steps.

Decode batches (one new token per request, or with speculative decoding `1 + k` tokens per
request: the last token and k drafts) are padded up to a captured batch size and replayed. One
graph is captured per (batch size, tokens per request). Everything the graph reads lives in
persistent buffers that each step overwrites in place: token ids, positions,
`query_start_loc`, `seq_lens`, per-group slot mappings and block tables. Padding rows have
sequence length 0 (the kernels skip them), slot -1 (nothing is written) and block-table rows of
the null block. The step's `CommonAttentionMetadata` has `graph_step=True`: its host per-request
fields are placeholders, so a backend whose plan needs per-request values computes them on the
device; when that is all its plan needs (`plans_inside_cuda_graphs()`, DeepSeek-V4's cache
users), its `prep_forward` is captured in the graph with the forward and replays re-plan on the
device.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from unified_attn.backend import AttentionBackend, CommonAttentionMetadata
from unified_attn.runner.gc_heap import gc_paused


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to 64, then of 32, ending at `max_num_seqs`."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, min(64, max_num_seqs) + 1, 8))
    sizes += list(range(96, max_num_seqs + 1, 32))
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    """One captured graph per decode batch size (`capture_sizes`) and tokens per request
    (`query_lens`: 1, and `1 + k` with k draft tokens) over persistent buffers; `run` copies a
    step into the buffers, lets the backends plan on them, and replays."""

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
        query_lens: tuple[int, ...] = (1,),
    ) -> None:
        self.model = model
        self.backend_groups = backend_groups
        self.max_model_len = max_model_len
        self.block_sizes = dict(enumerate(block_sizes))
        self.sizes = capture_sizes(max_num_seqs)
        self.query_lens = tuple(sorted(set(query_lens)))
        n = self.sizes[-1]
        t = n * self.query_lens[-1]  # tokens of the largest step
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=device)
        self.positions = torch.zeros(t, dtype=torch.int64, device=device)
        # query_start_loc of q tokens per request: fixed, one buffer per q
        self.query_start_loc = {
            q: torch.arange(n + 1, dtype=torch.int32, device=device) * q for q in self.query_lens
        }
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.slots = [torch.full((t,), -1, dtype=torch.int64, device=device) for _ in table_widths]
        self.tables = [torch.zeros(n, w, dtype=torch.int32, device=device) for w in table_widths]
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        # Per (size, q), views of the persistent buffers: built once, reused every replay.
        self.commons: dict[tuple[int, int], CommonAttentionMetadata] = {}
        self.logits: dict[tuple[int, int], torch.Tensor] = {}
        self.pool: Any = None  # the graphs share one memory pool
        self.num_replays = 0

    def bucket(self, num_reqs: int) -> int | None:
        return next((s for s in self.sizes if s >= num_reqs), None)

    def _common(self, n: int, q: int) -> CommonAttentionMetadata:
        if (n, q) not in self.commons:
            self.commons[n, q] = self._make_common(n, q)
        return self.commons[n, q]

    def _make_common(self, n: int, q: int) -> CommonAttentionMetadata:
        qsl = self.query_start_loc[q][: n + 1]
        return CommonAttentionMetadata(
            query_start_loc=qsl,
            query_start_loc_cpu=torch.arange(n + 1, dtype=torch.int32) * q,
            seq_lens=self.seq_lens[:n],
            seq_lens_cpu=torch.zeros(n, dtype=torch.int32),
            num_computed_tokens_cpu=torch.zeros(n, dtype=torch.int32),
            positions=self.positions[: n * q],
            num_reqs=n,
            num_actual_tokens=n * q,
            max_query_len=q,
            max_seq_len=self.max_model_len,  # the split-KV plan must cover any length
            slot_mappings={gid: s[: n * q] for gid, s in enumerate(self.slots)},
            block_sizes=self.block_sizes,
            graph_step=True,
        )

    def _prep(self, n: int, q: int, capture: bool, inside: bool) -> None:
        """`prep_forward` of the backends that plan outside the graphs (`inside` False: before
        each replay) or inside them (`plans_inside_cuda_graphs()`: captured with the forward)."""
        common = self._common(n, q)
        for backend, gids in self.backend_groups:
            if type(backend).plans_inside_cuda_graphs() == inside:
                tables = {gid: self.tables[gid][:n] for gid in gids}
                backend.prep_forward(common, tables, for_cudagraph_capture=capture)

    def step_logits(self, n: int, q: int) -> torch.Tensor:
        """What graph `(n, q)` runs: the plans made inside the graph, then the model over the
        persistent buffers; the logits of every padded row."""
        self._prep(n, q, capture=True, inside=True)
        hidden = self.model(self.input_ids[: n * q], self.positions[: n * q])
        return cast(torch.Tensor, self.model.compute_logits(hidden))

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest step first, so persistent scratch buffers are sized before any capture; no
        garbage collection meanwhile (`gc_heap.gc_paused`)."""
        with gc_paused():
            self._capture_all()

    def _capture_all(self) -> None:
        for q in reversed(self.query_lens):
            for n in reversed(self.sizes):
                self._prep(n, q, capture=True, inside=False)
                self.step_logits(n, q)  # warm-up, outside the graph
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.logits[n, q] = self.step_logits(n, q)
                self.pool = graph.pool()
                self.graphs[n, q] = graph

    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,
        common: CommonAttentionMetadata,
        tables: dict[int, torch.Tensor],
    ) -> torch.Tensor:
        """Logits `[num_reqs * q, vocab]` of a decode step whose requests all have q tokens, by
        replaying the padded graph."""
        n, q = self.stage(input_ids, common, tables)
        self.graphs[n, q].replay()
        self.num_replays += 1
        return self.logits[n, q][: common.num_reqs * q]

    def stage(
        self,
        input_ids: torch.Tensor,
        common: CommonAttentionMetadata,
        tables: dict[int, torch.Tensor],
    ) -> tuple[int, int]:
        """Copy a decode step into the persistent buffers, padded to its captured size `(n, q)`,
        and let the backends plan on them: what a replay of graph `(n, q)` then reads."""
        b, q = common.num_reqs, common.max_query_len
        n = self.bucket(b)
        assert n is not None and q in self.query_lens, "no graph was captured for this step"
        tokens = b * q
        self.input_ids[:tokens].copy_(input_ids, non_blocking=True)
        self.positions[:tokens].copy_(common.positions, non_blocking=True)
        self.seq_lens[:b].copy_(common.seq_lens, non_blocking=True)
        self.seq_lens[b:n].zero_()
        for gid, slots in enumerate(self.slots):
            slots[:tokens].copy_(common.slot_mappings[gid], non_blocking=True)
            slots[tokens : n * q].fill_(-1)
            table = tables[gid]
            self.tables[gid][:b, : table.shape[1]].copy_(table, non_blocking=True)
            self.tables[gid][b:n].zero_()
        self._prep(n, q, capture=False, inside=False)
        return n, q
