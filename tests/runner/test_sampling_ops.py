"""Batched sampling (`sampling_ops`, `Sampler.sample`): the batched filters against the per-row
reference they replace, the exponential race against the distribution it samples (and a wrong
one it must reject), seeded requests that ignore the rest of the batch, greedy rows, and one
transfer to the host per step."""

from __future__ import annotations

import itertools

import pytest
import torch

from unified_attn import SamplingParams
from unified_attn.request import Request
from unified_attn.runner.sampler import Sampler, filter_logits
from unified_attn.runner.sampling_ops import (
    SamplingTensors,
    exponential_race,
    filter_batch,
    sample_batch,
)

CPU = torch.device("cpu")


def reference_filter(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The per-row filter the batched one replaces (the sampler's `filter_logits` before it
    was batched): temperature, min-p, top-k, top-p on one row `[V]`."""
    logits = logits / params.temperature
    if params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < probs.max() * params.min_p, float("-inf"))
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


VOCAB = 64
MIXED = [
    SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
    for t, k, p, m in itertools.product(
        [0.5, 1.0, 1.7], [0, -1, 1, 5, VOCAB - 1, VOCAB, VOCAB + 10], [1.0, 0.9, 0.3], [0.0, 0.1]
    )
]


def mixed_logits(seed: int, ties: bool) -> torch.Tensor:
    logits = torch.randn(len(MIXED), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    # ties: a handful of distinct values, so the k-th value and the top-p boundary are shared
    return (logits * 2).round() / 2 if ties else logits


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_batched_filter_equals_the_per_row_reference(seed):
    logits = mixed_logits(seed, ties=False)
    got = filter_batch(logits, SamplingTensors.build(MIXED, VOCAB, CPU))
    for i, params in enumerate(MIXED):
        want = reference_filter(logits[i], params)
        assert torch.equal(got[i], want), params
        assert torch.equal(filter_logits(logits[i], params), want), params


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ties_keep_every_logit_at_the_kth_value_and_the_same_top_p_mass(seed):
    """Top-k has no order: rows without top-p equal the reference exactly. Top-p's boundary
    inside a tie depends on the order of equal logits (ours: vocabulary order), so rows with
    it keep the same multiset of values as the reference."""
    logits = mixed_logits(seed, ties=True)
    got = filter_batch(logits, SamplingTensors.build(MIXED, VOCAB, CPU))
    for i, params in enumerate(MIXED):
        want = reference_filter(logits[i], params)
        if params.top_p == 1.0:
            assert torch.equal(got[i], want), params
        assert torch.equal(got[i].sort().values, want.sort().values), params
    # a row with top-k 5 whose 5th value is shared: all its equals stay
    row = torch.tensor([3.0, 2.0, 2.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    kept = filter_logits(row, SamplingParams(temperature=1.0, top_k=5))
    assert torch.isfinite(kept).tolist() == [True] * 7 + [False]


def test_top_k_reads_only_the_largest_k_in_use():
    params = [SamplingParams(temperature=1.0, top_k=k) for k in (0, 1, 3, 7, 20, VOCAB, 99)]
    tensors = SamplingTensors.build(params, VOCAB, CPU)
    assert tensors.top_p is None and tensors.max_top_k == 20
    assert tensors.top_k is not None and tensors.top_k.tolist() == [
        VOCAB,
        1,
        3,
        7,
        20,
        VOCAB,
        VOCAB,
    ]
    logits = mixed_logits(4, ties=True)[: len(params)]
    got = filter_batch(logits, tensors)
    for i, p in enumerate(params):
        assert torch.equal(got[i], reference_filter(logits[i], p)), p


def test_stages_no_row_uses_are_skipped():
    tensors = SamplingTensors.build([SamplingParams(temperature=1.0)] * 3, VOCAB, CPU)
    assert tensors == SamplingTensors(None, None, None, 0, None)
    logits = torch.randn(3, VOCAB)
    assert filter_batch(logits, tensors) is logits


# ---- the exponential race ---------------------------------------------------------------------

# the 0.999 quantiles of chi-square by degrees of freedom
CHI2_999 = {3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    support = probs > 0
    expected = probs[support] * counts.sum()
    return float(((counts[support] - expected) ** 2 / expected).sum())


def race_counts(params: SamplingParams, row: torch.Tensor, draws: int) -> torch.Tensor:
    logits = row.repeat(draws, 1)
    tokens = sample_batch(
        logits,
        SamplingTensors.build([params] * draws, row.shape[-1], CPU),
        {},
        torch.Generator().manual_seed(1234),
    )
    return torch.bincount(tokens, minlength=row.shape[-1]).double()


def test_the_exponential_race_draws_the_filtered_distribution_and_rejects_a_wrong_one():
    """20000 draws over 10 tokens, filtered by temperature, top-k 8 and top-p 0.95: the
    filtered-out tokens never come, and the counts pass a chi-square test against the filtered
    softmax (fixed seeds: no flakes) but fail it against a distribution 2% of mass off."""
    row = torch.tensor([2.0, 1.6, 1.5, 1.1, 0.9, 0.7, 0.2, -0.4, -1.0, -3.0])
    params = SamplingParams(temperature=0.8, top_k=8, top_p=0.95)
    probs = torch.softmax(reference_filter(row, params), dim=-1).double()
    support = int((probs > 0).sum())
    assert support == 7  # top-p removed one more token than top-k
    counts = race_counts(params, row, 20000)
    assert counts[probs == 0].sum() == 0
    threshold = CHI2_999[support - 1]
    assert chi_square(counts, probs) < threshold
    wrong = probs.clone()
    wrong[0] -= 0.02
    wrong[3] += 0.02
    assert chi_square(counts, wrong) > threshold
    # the race itself, on given probabilities that need not sum to 1
    target = torch.tensor([0.5, 0.0, 0.25, 0.15, 0.1, 0.0], dtype=torch.float64)
    tokens = exponential_race(
        (3 * target).float().repeat(20000, 1), {}, torch.Generator().manual_seed(5)
    )
    counts = torch.bincount(tokens, minlength=6).double()
    assert counts[target == 0].sum() == 0
    assert chi_square(counts, target) < CHI2_999[3]


def test_a_seeded_row_draws_its_noise_from_its_own_generator_only():
    probs = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(0)), -1)
    alone = exponential_race(probs[2:3], {0: torch.Generator().manual_seed(9)}, None)
    default = torch.Generator().manual_seed(1)
    together = exponential_race(probs, {2: torch.Generator().manual_seed(9)}, default)
    assert together[2] == alone[0]


# ---- the sampler ------------------------------------------------------------------------------


def request(request_id: str, **params) -> Request:
    return Request(request_id, [1, 2], sampling_params=SamplingParams(**params))


SEEDED = dict(temperature=1.2, top_p=0.9, top_k=40, min_p=0.02, seed=77)


def others() -> list[Request]:
    """Requests to share a batch with: greedy, unseeded sampled and other seeded ones."""
    return [
        request("g", temperature=0.0),
        request("u1", temperature=0.9, top_p=0.8),
        request("s2", temperature=1.5, seed=77),  # the same seed, its own generator
        request("u2", temperature=1.0, top_k=5, min_p=0.1),
        request("g2", temperature=0.0, frequency_penalty=0.5),
    ]


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_a_seeded_request_samples_the_same_tokens_alone_and_in_any_batch(batch_invariant):
    vocab, steps = 100, 25
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randn(vocab, generator=gen) * 2 for _ in range(steps)]
    alone_sampler = Sampler(CPU, seed=0, batch_invariant=batch_invariant)
    mixed_sampler = Sampler(CPU, seed=1, batch_invariant=batch_invariant)
    alone, mixed = request("s", **SEEDED), request("s", **SEEDED)
    batch = others()
    for step, row in enumerate(rows):
        (a,) = alone_sampler.sample(row[None], [alone]).tokens
        requests = list(batch)
        position = step % (len(requests) + 1)  # the seeded row moves around the batch
        requests.insert(position, mixed)
        logits = torch.randn(len(requests), vocab, generator=gen) * 2
        logits[position] = row
        b = mixed_sampler.sample(logits, requests).tokens[position]
        assert a == b, step
        alone.append_output_token_ids(a)
        mixed.append_output_token_ids(b)
    assert len(set(alone.output_token_ids)) > 3  # it did sample


def test_a_mixed_batch_keeps_greedy_exact_and_draws_inside_the_filters():
    vocab = 300
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(8)) * 3
    requests = [
        request("g", temperature=0.0),
        request("k1", temperature=2.0, top_k=1),  # one token left: the argmax
        request("s", temperature=1.0, top_k=4, seed=5),
        request("p", temperature=0.7, top_p=0.5),
        request("m", temperature=1.0, min_p=0.5),
        request("g2", temperature=0.0, presence_penalty=1.0),
    ]
    logits[5, 10], logits[5, 11] = 20.0, 19.5  # the penalty on 10 (output) makes 11 the best
    for r in requests:
        r.append_output_token_ids(10)
    sampler = Sampler(CPU, seed=0)
    for _ in range(20):
        tokens = sampler.sample(logits, requests).tokens
        assert tokens[0] == int(logits[0].argmax())
        assert tokens[1] == int(logits[1].argmax())
        for i in (2, 3, 4):
            kept = reference_filter(logits[i], requests[i].sampling_params)
            assert torch.isfinite(kept[tokens[i]])
        processed = sampler._process_row(logits[5], requests[5])
        assert tokens[5] == int(processed.argmax()) == 11


def test_a_seeded_request_repeats_with_a_fresh_sampler():
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(2))
    requests = [request(f"r{i}", temperature=1.0, seed=i) for i in range(3)]
    first = Sampler(CPU, seed=0).sample(logits, requests).tokens
    assert Sampler(CPU, seed=99).sample(logits, requests).tokens == first


def test_sampling_a_batch_reads_the_device_once(monkeypatch):
    """No `.item()`, no per-row reads: one `.tolist()` of the tokens per step (no row asks for
    log-probabilities), whatever mix of greedy, seeded and filtered rows."""
    calls: list[str] = []
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    sampled = [
        request("a", temperature=0.8, top_p=0.9),
        request("b", temperature=1.0, top_k=20, seed=3),
        request("c", temperature=1.3, min_p=0.05, top_k=7, top_p=0.7, seed=4),
        request("d", temperature=1.0, presence_penalty=0.3),
    ]
    for r in sampled:
        r.append_output_token_ids(7)
    sampler = Sampler(CPU, seed=0)
    for requests in (sampled, [*sampled, request("g", temperature=0.0)]):
        logits = torch.randn(len(requests), 500)
        calls.clear()
        tokens = sampler.sample(logits, requests).tokens
        assert calls == ["tolist"]
        assert len(tokens) == len(requests) and all(isinstance(t, int) for t in tokens)
