"""DeepSeek-V4 decode steps as CUDA graphs run them, on the CPU (float32, reference backends).

A graph step is padded to a captured batch size and its host per-request fields are
placeholders (`graph_step=True`); the V4 cache users plan it on the device, inside the graph
(`plans_inside_cuda_graphs`). Here `DecodeGraphs` stages every decode step into its persistent
buffers exactly as on CUDA, and a stand-in "graph" runs what a captured graph runs
(`DecodeGraphs.step_logits`: the in-graph plans, then the model) eagerly. The tokens and logits
must be transformers' (the GPU replays real graphs: tests/gpu/test_v4_graphs_gpu.py).
"""

from __future__ import annotations

import attrs
import pytest
import torch

from tests.models.hf_models import save_hf_model
from tests.models.test_deepseek_hf import PARAMS, check_engine, check_tokens, prompts
from tests.models.test_deepseek_v4_hf import MEMORY, make_v4
from unified_attn import LLMEngine
from unified_attn.backend import CommonAttentionMetadata
from unified_attn.backends.deepseek_v4_steps import StepLayout, closing_windows, step_layout
from unified_attn.runner.cuda_graphs import DecodeGraphs


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = make_v4()
    return hf, save_hf_model(hf, tmp_path_factory.mktemp("v4_graphs"))


class StandInGraph:
    """Graph `(n, q)` of `DecodeGraphs`, run eagerly: a replay computes what the captured graph
    computes, over the same persistent buffers."""

    def __init__(self, graphs: DecodeGraphs, n: int, q: int) -> None:
        self.graphs, self.n, self.q = graphs, n, q
        self.replays = 0

    def replay(self) -> None:
        self.graphs.logits[self.n, self.q] = self.graphs.step_logits(self.n, self.q)
        self.replays += 1


def stand_in_graphs(engine: LLMEngine, query_lens: tuple[int, ...] = (1,)) -> DecodeGraphs:
    """The engine's runner replays stand-in graphs, "captured" in `DecodeGraphs.capture`'s
    order (largest step first)."""
    runner = engine.runner
    graphs = DecodeGraphs(
        runner.model, runner.backend_groups, [t.shape[1] for t in runner.block_tables.tables],
        runner.block_sizes, max_num_seqs=engine.config.max_num_seqs,
        max_model_len=engine.max_model_len, device="cpu", query_lens=query_lens,
    )  # fmt: skip
    assert all(type(b).plans_inside_cuda_graphs() for b, _ in runner.backend_groups)
    for q in reversed(graphs.query_lens):
        for n in reversed(graphs.sizes):
            graphs.graphs[n, q] = StandInGraph(graphs, n, q)  # type: ignore[assignment]
    runner.graphs = graphs
    return graphs


def test_graph_decode_steps_match_transformers(checkpoint):
    # Four requests pad to the captured size 4, then 3 -> 4, 2, 1 as they finish at different
    # lengths; windows of 4 (CSA) and 8 (HCA) close in about every fourth step, and the
    # compressed caches are read up to max_model_len's entries.
    hf, path = checkpoint
    engine = LLMEngine(str(path), kv_cache_memory=MEMORY, max_model_len=112, block_size=8,
                       max_num_seqs=4)  # fmt: skip
    graphs = stand_in_graphs(engine)
    batch = prompts([23, 5, 50, 1])
    params = [attrs.evolve(PARAMS, max_tokens=n) for n in (32, 20, 32, 9)]
    outputs = engine.generate(batch, params)
    assert graphs.num_replays > 20
    assert {n for n, _ in graphs.graphs} >= {1, 2, 4}
    for prompt, out in zip(batch, outputs, strict=True):
        full = check_tokens(hf, prompt, out.output_token_ids)
        sampled = full[len(prompt) - 1 : len(prompt) - 1 + len(out.output_token_ids)]
        assert (out.logits - sampled).abs().max() < 1e-4


def test_verification_steps_of_several_tokens_close_every_window_they_reach(checkpoint):
    # ngram drafts of 3: steps of 4 tokens per request, in which a CSA window (rate 4) always
    # closes and up to one HCA window (rate 8) may.
    hf, path = checkpoint
    options = dict(speculative_method="ngram", num_speculative_tokens=3)
    engine = LLMEngine(str(path), kv_cache_memory=MEMORY, max_model_len=112, block_size=8,
                       max_num_seqs=4, **options)  # fmt: skip
    graphs = stand_in_graphs(engine, query_lens=(1, 4))
    batch = [[5, 6, 7, 8, 9, 10, 11, 12] * 4, [3, 4] * 10, prompts([17])[0]]
    outputs = engine.generate(batch, PARAMS)
    assert any(g.replays for (_, q), g in graphs.graphs.items() if q == 4)  # type: ignore[attr-defined]
    assert engine.stats.spec_accepted > 0
    check_engine(hf, outputs, batch, prompt_logits=False)


def padded_common(seq_lens: list[int], q: int, max_seq_len: int) -> CommonAttentionMetadata:
    """A graph step's metadata: device fields only are real (positions of the last q tokens of
    each request; padding rows have length 0)."""
    n = len(seq_lens)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    positions = torch.cat([torch.arange(max(s - q, 0), max(s - q, 0) + q) for s in seq_lens])
    zeros = torch.zeros(n, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=torch.arange(n + 1, dtype=torch.int32) * q,
        query_start_loc_cpu=torch.arange(n + 1, dtype=torch.int32) * q, seq_lens=lens,
        seq_lens_cpu=zeros, num_computed_tokens_cpu=zeros, positions=positions, num_reqs=n,
        num_actual_tokens=n * q, max_query_len=q, max_seq_len=max_seq_len,
        slot_mappings={}, graph_step=True,
    )  # fmt: skip


def test_a_graph_step_closes_the_windows_an_eager_step_closes():
    # rate 4, q = 4: one window slot per request row. 6 -> 10 tokens closes window 1, 0 -> 4
    # window 0, 9 -> 13 window 2; the row of length 0 is padding (its slot is not live).
    layout = step_layout(padded_common([10, 0, 4, 13], q=4, max_seq_len=64))
    request, window, live = closing_windows(layout, 4)
    assert (request.tolist(), window.tolist(), live.tolist()) == (
        [0, 1, 2, 3], [1, 0, 0, 2], [True, False, True, True])  # fmt: skip
    assert layout.live.tolist() == [True] * 4 + [False] * 4 + [True] * 8
    eager = StepLayout(torch.tensor([0]), torch.tensor([9]), torch.tensor([9]),
                       torch.tensor([10]))  # fmt: skip
    assert [t.tolist() for t in closing_windows(eager, 4)] == [[], [], []]


@pytest.mark.parametrize("q, rate", [(1, 4), (4, 4), (5, 4), (3, 8), (9, 2)])
def test_a_graph_step_has_room_for_every_window_that_can_close(q, rate):
    # Every cached length and padding: the live windows are exactly the eager step's.
    for computed in range(0, 3 * rate):
        seq_lens = [computed + q, 0]
        request, window, live = closing_windows(step_layout(padded_common(seq_lens, q, 64)), rate)
        closes = list(range(computed // rate, (computed + q) // rate))
        assert window[live].tolist() == closes and request[live].tolist() == [0] * len(closes)
        assert not live[request == 1].any()
