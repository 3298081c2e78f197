"""DeepSeek-V4's reference cache users on their own, against dense recomputation: the
compressor's window of raw rows across steps that do not align with the rate (also with blocks
outside the window freed), compressed entries landing at their window index, the indexer's
top-k, attention restricted to it; bad inputs; the cache triples; and the KV-cache groups
listed from those triples alone, with no DeepSeek-specific code in the worker, scheduler or
managers. The layer's attention with the sinks: test_deepseek_v4_layer_attention.py."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from unified_attn.backend import CommonAttentionMetadata, LayerConfig
from unified_attn.backends.deepseek_v4_window import (
    CompressedAttentionBackend,
    CompressorStateBackend,
    DeepseekV4WindowBackend,
    LightningIndexerBackend,
)
from unified_attn.managers import FullAttentionManager, SlidingWindowManager
from unified_attn.models import V4_PRESETS, DeepseekV4ForCausalLM
from unified_attn.runner.worker import plan_kv_cache
from unified_attn.tensor_specs import CompressedLatentSpec, LatentKVSpec, PagedKVSpec

RATE, BS, F32 = 4, 8, torch.float32
# chunks per step of two requests: windows of 4 tokens close in a later step than they open
CHUNKS = [[3, 5], [2, 7], [6, 1], [5, 3], [1, 1]]
SEQ = [sum(step[i] for step in CHUNKS) for i in range(2)]  # [17, 17]


class Bound:
    """One backend over its own buffer: one group (id 0), request i on blocks
    `1 + i * blocks_per_request, ...`; block 0 is the null block."""

    def __init__(self, backend, layers: list[LayerConfig], max_len: int = 24) -> None:
        self.backend, self.layers = backend, layers
        self.per_request = math.ceil(max_len / BS)
        num_blocks = 1 + 2 * self.per_request
        _, _, spec = backend.get_cache_config()
        page = spec.page_size_bytes(BS)
        stride = page * len(layers)
        self.buffer = torch.zeros(num_blocks * stride, dtype=torch.uint8)
        views = {
            layer.name: spec.make_view(self.buffer, i * page, stride, num_blocks, BS)
            for i, layer in enumerate(layers)
        }
        backend.bind_kv_caches(views, dict.fromkeys(views, 0))
        ids = 1 + torch.arange(2 * self.per_request, dtype=torch.int32)
        self.table = ids.view(2, self.per_request)
        self.computed = [0, 0]

    def step(self, new: list[int], table: torch.Tensor | None = None) -> CommonAttentionMetadata:
        table = self.table if table is None else table
        computed = torch.tensor(self.computed, dtype=torch.int32)
        seq = computed + torch.tensor(new, dtype=torch.int32)
        qsl = torch.tensor([0, new[0], new[0] + new[1]], dtype=torch.int32)
        positions = torch.cat([torch.arange(c, s) for c, s in zip(computed, seq, strict=True)])
        req = torch.repeat_interleave(torch.arange(2), torch.tensor(new))
        slots = table[req, positions // BS].long() * BS + positions % BS
        common = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, seq_lens_cpu=seq,
            num_computed_tokens_cpu=computed, positions=positions, num_reqs=2,
            num_actual_tokens=int(qsl[-1]), max_query_len=max(new), max_seq_len=int(seq.max()),
            slot_mappings={0: slots}, block_sizes={0: BS},
        )  # fmt: skip
        self.backend.prep_forward(common, {0: table})
        self.computed = seq.tolist()
        return common


def layer(user: str, heads: int, size: int, window: int | None = None, scale: float = 0.5):
    return LayerConfig(f"model.layers.0.self_attn.{user}", heads, 1, size, scale, window)


def rows(new: list[int], full: list[torch.Tensor], computed: list[int]) -> torch.Tensor:
    """The new tokens' rows of per-request `full [S, ...]` tensors, packed."""
    return torch.cat([f[c : c + n] for f, c, n in zip(full, computed, new, strict=True)])


def closing(computed: list[int], new: list[int], rate: int) -> list[tuple[int, int]]:
    return [
        (b, w) for b in range(2) for w in range(computed[b] // rate, (computed[b] + new[b]) // rate)
    ]


# ---- the compressor's window -------------------------------------------------------------------


def freed_table(bound: Bound, new: list[int], span: int) -> torch.Tensor:
    """The block table as the sliding-window manager leaves it: blocks whose every token is
    before `computed - span + 1` point at the null block (filled with NaN here)."""
    table = bound.table.clone()
    for b, computed in enumerate(bound.computed):
        skipped = max(0, computed - span + 1)
        table[b, : skipped // BS] = 0
    bound.backend.kv_caches[bound.layers[0].name][0] = float("nan")
    return table


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("freed", [False, True])
def test_compressor_gathers_every_closing_window_across_steps(overlap, freed):
    width = 6
    backend = CompressorStateBackend(
        head_size=width, dtype=F32, compress_rate=RATE, overlap=overlap
    )
    span = backend.span
    assert span == (2 * RATE if overlap else RATE)
    bound = Bound(backend, [layer("compressor", 1, width, span)])
    gen = torch.Generator().manual_seed(0)
    kv_full = [torch.randn(s, width, generator=gen) for s in SEQ]
    gate_full = [torch.randn(s, width, generator=gen) for s in SEQ]
    nulled = 0
    for new in CHUNKS:
        before = list(bound.computed)
        table = freed_table(bound, new, span) if freed else bound.table
        nulled += int((table == 0).sum())
        bound.step(new, table)
        count, starts = backend.closing_windows()
        expected = closing(before, new, RATE)
        assert count == len(expected) and starts.tolist() == [w * RATE for _, w in expected]
        out = torch.empty(count, 2, span, width)
        kv, gate = rows(new, kv_full, before), rows(new, gate_full, before)
        backend.forward(bound.layers[0], out, kv, kv, gate)
        for i, (b, w) in enumerate(expected):
            first = (w + 1) * RATE - span
            for j in range(span):
                pos = first + j
                want_kv = kv_full[b][pos] if pos >= 0 else torch.zeros(width)
                want_gate = gate_full[b][pos] if pos >= 0 else torch.full((width,), -math.inf)
                assert torch.equal(out[i, 0, j], want_kv) and torch.equal(out[i, 1, j], want_gate)
    assert (nulled > 0) == freed  # freed runs did read through a NaN-filled null block


# ---- compressed entries and attention over them ----------------------------------------------


def dense_partial(q, keys, visible, scale):
    """Per token: softmax over its visible keys (out 0 and lse -inf when none)."""
    scores = torch.einsum("thd,tsd->ths", q, keys) * scale
    scores = scores.masked_fill(~visible[:, None], -math.inf)
    lse = torch.logsumexp(scores, -1)
    probs = torch.nan_to_num(torch.exp(scores - lse[..., None]))
    return torch.einsum("ths,tsd->thd", probs, keys), lse


def entry_steps(bound, dim, heads, seed=1):
    """Yield per step (new, positions, request, q, entries written, all entries so far)."""
    gen = torch.Generator().manual_seed(seed)
    entries_full = [torch.randn(s // RATE, dim, generator=gen) for s in SEQ]
    for new in CHUNKS:
        before = list(bound.computed)
        common = bound.step(new)
        order = closing(before, new, RATE)
        entries = torch.stack([entries_full[b][w] for b, w in order]) if order else None
        q = torch.randn(sum(new), heads, dim, generator=gen)
        request = torch.repeat_interleave(torch.arange(2), torch.tensor(new))
        yield common.positions, request, q, entries, entries_full


def test_compressed_entries_land_at_their_window_index_and_attention_matches_dense():
    heads, dim = 2, 8
    backend = CompressedAttentionBackend(head_size=dim, dtype=F32, compress_rate=RATE)
    bound = Bound(backend, [layer("compressed", heads, dim)])
    for positions, request, q, entries, full in entry_steps(bound, dim, heads):
        entries = torch.empty(0, dim) if entries is None else entries
        out, lse = torch.empty(q.shape[0], heads * dim), torch.empty(q.shape[0], heads)
        backend.forward(bound.layers[0], out, q, entries, entries, lse=lse)
        keys = torch.stack([full[int(b)] for b in request])  # [T, E, D]
        visible = torch.arange(keys.shape[1]) < ((positions + 1) // RATE)[:, None]
        want_out, want_lse = dense_partial(q, keys, visible, 0.5)
        assert torch.allclose(out.view(q.shape), want_out, atol=1e-5)
        assert torch.allclose(lse, want_lse, atol=1e-5, equal_nan=True)
    view = backend.kv_caches[bound.layers[0].name]  # [num_blocks, BS // RATE, dim]
    for b in range(2):
        for w in range(SEQ[b] // RATE):
            block, offset = bound.table[b, w * RATE // BS], (w * RATE % BS) // RATE
            assert torch.equal(view[block, offset], full[b][w])


def test_every_complete_entry_is_a_prefix_the_rows_state_the_length_of():
    # HCA reads every complete entry: the rows carry each token's count, which a kernel may
    # stop at; a top-k selection is no prefix and carries none.
    heads, dim = 2, 8
    backend = CompressedAttentionBackend(head_size=dim, dtype=F32, compress_rate=RATE)
    bound = Bound(backend, [layer("compressed", heads, dim)])
    for positions, _, q, entries, _ in entry_steps(bound, dim, heads):
        entries = torch.empty(0, dim) if entries is None else entries
        rows = backend.gather_rows(bound.layers[0], q, entries)
        assert rows.lengths is not None
        assert rows.lengths.tolist() == ((positions + 1) // RATE).tolist()
        prefix = torch.arange(rows.visible.shape[1]) < rows.lengths[:, None]
        assert torch.equal(rows.visible, prefix)
        topk = torch.zeros(q.shape[0], 2, dtype=torch.int64)
        assert backend.gather_rows(bound.layers[0], q, entries, topk).lengths is None


def test_attention_sees_only_the_top_k_entries_it_is_given():
    heads, dim = 2, 8
    backend = CompressedAttentionBackend(head_size=dim, dtype=F32, compress_rate=RATE)
    bound = Bound(backend, [layer("compressed", heads, dim)])
    gen = torch.Generator().manual_seed(5)
    for positions, request, q, entries, full in entry_steps(bound, dim, heads):
        entries = torch.empty(0, dim) if entries is None else entries
        topk = torch.randint(-1, 5, (q.shape[0], 2), generator=gen)  # -1: none
        out, lse = torch.empty(q.shape[0], heads * dim), torch.empty(q.shape[0], heads)
        backend.forward(bound.layers[0], out, q, entries, entries, lse=lse, topk=topk)
        keys = torch.stack([full[int(b)] for b in request])
        chosen = torch.zeros(keys.shape[:2], dtype=torch.bool)
        for t, picks in enumerate(topk.tolist()):
            chosen[t, [p for p in picks if 0 <= p < keys.shape[1]]] = True
        visible = chosen & (torch.arange(keys.shape[1]) < ((positions + 1) // RATE)[:, None])
        want_out, want_lse = dense_partial(q, keys, visible, 0.5)
        assert torch.allclose(out.view(q.shape), want_out, atol=1e-5)
        assert torch.allclose(lse, want_lse, atol=1e-5, equal_nan=True)


def test_indexer_top_k_matches_a_dense_selection():
    heads, dim, k = 3, 8, 3
    backend = LightningIndexerBackend(head_size=dim, dtype=F32, compress_rate=RATE)
    bound = Bound(backend, [layer("indexer", heads, dim, scale=dim**-0.5)])
    gen = torch.Generator().manual_seed(3)
    saw_full_top_k = False
    for positions, request, q, entries, full in entry_steps(bound, dim, heads, seed=2):
        entries = torch.empty(0, dim) if entries is None else entries
        weights = torch.randn(q.shape[0], heads, generator=gen)
        picks = torch.empty(q.shape[0], k, dtype=torch.int64)
        backend.forward(bound.layers[0], picks, q, entries, entries, weights=weights)
        for t in range(q.shape[0]):
            keys = full[int(request[t])][: (int(positions[t]) + 1) // RATE]  # complete entries
            scores = (torch.relu(q[t] @ keys.T) * dim**-0.5 * weights[t][:, None]).sum(0)
            want = set(scores.topk(min(k, len(keys))).indices.tolist())
            got = picks[t].tolist()
            assert set(got) - {-1} == want and got.count(-1) == k - len(want)
            saw_full_top_k |= len(keys) > k
    assert saw_full_top_k  # some query chose among more entries than it keeps


# ---- bad inputs and construction -------------------------------------------------------------


def bad_input_cases():
    swa = DeepseekV4WindowBackend(head_size=8, dtype=F32, sliding_window=4)
    compressed = CompressedAttentionBackend(head_size=8, dtype=F32, compress_rate=RATE)
    indexer = LightningIndexerBackend(head_size=8, dtype=F32, compress_rate=RATE)
    state = CompressorStateBackend(head_size=6, dtype=F32, compress_rate=RATE, overlap=True)
    q, kv, lse = torch.zeros(8, 2, 8), torch.zeros(8, 8), torch.zeros(8, 2)
    out = torch.zeros(8, 16)
    one = torch.zeros(2, 8)  # the two entries that close in the step
    yield swa, "swa", (out, q[:, :1], kv, kv), dict(lse=lse), r"query has shape \(8, 1, 8\)"
    yield swa, "swa", (out, q, kv, kv), {}, "forward needs lse"
    yield swa, "swa", (out, q.double(), kv, kv), dict(lse=lse), "query is torch.float64"
    yield compressed, "compressed", (out, q, kv, kv), dict(lse=lse), r"key \(entries\) has shape"
    yield (
        compressed,
        "compressed",
        (out, q, one, one),
        dict(lse=lse, topk=torch.zeros(8, 2)),
        ("topk is torch.float32"),
    )
    yield (
        indexer,
        "indexer",
        (torch.zeros(8, 3, dtype=torch.int64), q, one, one),
        {},
        ("forward needs weights"),
    )
    yield (
        state,
        "compressor",
        (torch.zeros(1, 2, 8, 6), kv[:, :6], kv[:, :6], kv[:, :6]),
        {},
        (r"output has shape \(1, 2, 8, 6\), expected \(2, 2, 8, 6\)"),
    )


@pytest.mark.parametrize("case", range(7))
def test_bad_inputs_raise_value_error_naming_the_layer(case):
    backend, user, args, kwargs, message = list(bad_input_cases())[case]
    window = getattr(backend, "sliding_window", None)
    bound = Bound(backend, [layer(user, 2, backend.head_size, window)])
    bound.step([4, 4])  # 8 tokens; windows 0 of both requests close
    with pytest.raises(
        ValueError, match=rf"layer model\.layers\.0\.self_attn\.{user}: .*{message}"
    ):
        backend.forward(bound.layers[0], *args, **kwargs)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: CompressedAttentionBackend(head_size=8, dtype=F32, compress_rate=0),
         "compress_rate must be a positive int"),
        (lambda: CompressorStateBackend(head_size=8, dtype=F32, compress_rate=2.5, overlap=True),
         "compress_rate must be a positive int"),
        (lambda: DeepseekV4WindowBackend(head_size=8, dtype=F32), "sliding_window is required"),
        (lambda: DeepseekV4WindowBackend(head_size=8, dtype=F32, sliding_window=4,
                                         num_kv_heads=2), "num_kv_heads=2, expected 1"),
        (lambda: LightningIndexerBackend(head_size=8, dtype=F32, compress_rate=4,
                                         sliding_window=8), "give num_kv_heads=1 and no window"),
    ],
)  # fmt: skip
def test_constructors_refuse_bad_parameters(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_the_model_refuses_a_backend_without_the_cache_user_classes():
    from unified_attn.backends.mla import MLAReferenceBackend

    with pytest.raises(ValueError, match=r"MLAReferenceBackend is not a DeepSeek-V4 backend"):
        DeepseekV4ForCausalLM(V4_PRESETS["deepseek-v4-like"], MLAReferenceBackend, device="meta")


# ---- the triples and the groups they make ------------------------------------------------------


def test_each_cache_user_declares_its_own_manager_and_spec():
    swa = DeepseekV4WindowBackend(head_size=32, dtype=F32, sliding_window=8)
    assert swa.get_cache_config() == (
        SlidingWindowManager, SlidingWindowManager.Config(8), LatentKVSpec(32, F32),
    )  # fmt: skip
    csa = CompressorStateBackend(head_size=64, dtype=F32, compress_rate=4, overlap=True)
    hca = CompressorStateBackend(head_size=32, dtype=F32, compress_rate=16, overlap=False)
    assert csa.get_cache_config()[:2] == (SlidingWindowManager, SlidingWindowManager.Config(8))
    assert hca.get_cache_config()[1] == SlidingWindowManager.Config(16)
    assert csa.get_cache_config()[2] == PagedKVSpec(1, 64, F32)
    entries = CompressedAttentionBackend(head_size=32, dtype=F32, compress_rate=4)
    assert entries.get_cache_config() == (
        FullAttentionManager, FullAttentionManager.Config(), CompressedLatentSpec(32, 4, F32),
    )  # fmt: skip


def test_compressed_spec_pages_whole_entries():
    spec = CompressedLatentSpec(head_size=512, compress_rate=128, dtype=torch.bfloat16)
    assert spec.page_size_bytes(256) == 2 * 512 * 2
    buffer = torch.zeros(3 * 4096, dtype=torch.uint8)
    view = spec.make_view(buffer, 0, 4096, 3, 256)
    assert view.shape == (3, 2, 512) and view.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="block_size=96 is not a multiple of compress_rate=128"):
        spec.page_size_bytes(96)


def test_groups_are_listed_from_the_backends_triples_alone():
    model = DeepseekV4ForCausalLM(V4_PRESETS["deepseek-v4-like"], DeepseekV4WindowBackend,
                                  device="meta")  # fmt: skip
    triples = {}
    for cfg, backend in model.attention_layers():
        manager_cls, config, spec = backend.get_cache_config()
        triples[cfg.name] = (manager_cls, config, spec)
    users = {re.sub(r"model\.layers\.\d+\.self_attn\.", "", name) for name in triples}
    assert users == {"swa", "compressor", "compressed", "indexer_compressor", "indexer"}
    plan = plan_kv_cache(model.attention_layers())
    listed = {(g.manager_cls, g.config) for g in plan.groups}
    assert listed == {(m, c) for m, c, _ in triples.values()}
    assert listed == {
        (SlidingWindowManager, SlidingWindowManager.Config(8)),
        (FullAttentionManager, FullAttentionManager.Config()),
    }
    for group in plan.groups:
        for lp in group.layers:
            assert triples[lp.layer.name] == (group.manager_cls, group.config, lp.spec)
        multiple = max(getattr(lp.spec, "block_size_multiple", 1) for lp in group.layers)
        assert group.block_size % multiple == 0
    assert sorted({g.block_size for g in plan.groups}) == [16, 64]
    assert plan.wasted_bytes_per_block() == [0] * len(plan.groups)


GENERIC = ["backend", "runner/worker.py", "runner/kv_plan.py", "runner/scheduler.py",
           "runner/model_runner.py", "engine/llm_engine.py", "runner/page_balance.py",
           "managers"]  # fmt: skip


@pytest.mark.parametrize("part", GENERIC)
def test_no_deepseek_special_case_in_the_generic_runtime(part):
    root = Path(__file__).resolve().parents[2] / "unified_attn" / part
    files = sorted(root.rglob("*.py")) if root.is_dir() else [root]
    assert files
    for file in files:
        assert "deepseek" not in file.read_text().lower(), f"{file} mentions DeepSeek"


def test_plan_lists_every_group_with_its_block_size_and_waste(capsys):
    import json

    from unified_attn.cli import main

    assert main(["plan", "--model", "deepseek-v4-like", "--max-num-batched-tokens", "64",
                 "--json"]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    groups = report["hybrid"]["groups"]
    assert [(g["manager"], g["block_size"]) for g in groups] == (
        [("SlidingWindowManager", 16)] * 5 + [("FullAttentionManager", 64)]
    )
    assert sum(g["layers"] for g in groups) == 5 + 3 * 4 + 2  # cache users of 5 layers
    assert {g["page_bytes"] for g in groups} == {report["hybrid"]["bytes_per_block"]}
    assert report["capacity_ratio"] > 2.0  # against one full latent per token and layer


def test_the_real_flash_shape_wastes_at_most_five_percent_per_group():
    from unified_attn.harness.capacity import REAL_V4_SHAPES, attention_layers

    flash = REAL_V4_SHAPES["deepseek-v4-flash"]
    plan = plan_kv_cache(attention_layers(flash, torch.bfloat16))
    pages = [g.page_bytes() for g in plan.groups]
    assert max(plan.wasted_bytes_per_block()) <= 0.05 * plan.bytes_per_block
    assert sum(len(g.layers) for g in plan.groups) == 43 + 41 * 2 + 21 * 2
    assert sorted({g.block_size for g in plan.groups}) == [16, 32, 512]
    assert max(pages) == plan.bytes_per_block == 704_512


# ---- the contract's part for layers with several cache users ------------------------------------


def test_a_backend_without_classes_for_every_cache_user_is_refused():
    from unified_attn.models.deepseek_v4 import CACHE_USER_ROLES
    from unified_attn.selector import SelectorConfig, select_backend

    class WindowOnly(DeepseekV4WindowBackend):
        name = "test-v4-window-only"

        @classmethod
        def cache_user_classes(cls):
            return {"compressor": super().cache_user_classes()["compressor"]}

    cfg = SelectorConfig(head_size=32, dtype="float32", sliding_window=8,
                         layer_kind="deepseek_v4", cache_users=CACHE_USER_ROLES)  # fmt: skip
    assert select_backend(cfg, override=DeepseekV4WindowBackend) is DeepseekV4WindowBackend
    with pytest.raises(ValueError, match=r"no class for the cache users \['compressed', 'indexer'"):
        select_backend(cfg, override=WindowOnly)
    with pytest.raises(ValueError, match="no class for the cache users"):
        DeepseekV4ForCausalLM(V4_PRESETS["deepseek-v4-like"], WindowOnly, device="meta")


def test_the_layer_checks_each_users_capabilities_when_it_is_built():
    """The model programs against the contract's protocols: a cache user whose backend lacks
    one is refused by name when the model is built, not in the middle of a step."""
    from unified_attn.backend import RowSetAttention, RowSource, WindowSource, as_capability
    from unified_attn.backends.reference import ReferenceAttentionBackend

    swa = DeepseekV4WindowBackend(head_size=32, dtype="float32", sliding_window=8)
    assert as_capability(swa, RowSource, "swa") is swa
    assert isinstance(swa, RowSetAttention) and not isinstance(swa, WindowSource)
    plain = ReferenceAttentionBackend(num_kv_heads=1, head_size=32, dtype="float32")
    with pytest.raises(TypeError, match=r"ReferenceAttentionBackend \(reference\) cannot serve "
                                        r"the model.layers.0.self_attn.swa cache user: it does "
                                        "not implement RowSource"):  # fmt: skip
        as_capability(plain, RowSource, "model.layers.0.self_attn.swa")

    class NoRows(DeepseekV4WindowBackend):
        name = "test-v4-no-rows"
        gather_rows = None  # type: ignore[assignment]

    with pytest.raises(TypeError, match=r"self_attn.swa cache user: it does not implement Row"):
        DeepseekV4ForCausalLM(V4_PRESETS["deepseek-v4-like"], NoRows, device="meta")
