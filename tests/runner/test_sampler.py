"""The sampler on small hand-made logits: penalties, `min_tokens`, log-probabilities and the
order they apply in, against references computed here by hand (and `torch.log_softmax`)."""

import math

import pytest
import torch

from unified_attn import SamplingParams
from unified_attn.request import Request
from unified_attn.runner.logits_processing import apply_penalties
from unified_attn.runner.sampler import Sampler

EOS = 5
# six tokens; the raw argmax is 5 (= EOS), then 0
LOGITS = torch.tensor([2.0, -1.0, 0.5, -0.5, 1.0, 3.0])


def request(prompt=(0, 3), output=(), request_id="r", **params) -> Request:
    r = Request(request_id, list(prompt), sampling_params=SamplingParams(**params))
    for token in output:
        r.append_output_token_ids(token)
    return r


def sample(requests, logits=None, eos=(EOS,)):
    rows = LOGITS.repeat(len(requests), 1) if logits is None else logits
    return Sampler(torch.device("cpu"), seed=0, eos_token_ids=eos).sample(rows, requests)


# ---- penalties ---------------------------------------------------------------------------------


def test_penalties_follow_vllms_definitions():
    # prompt {0, 3}; output 1, 1, 4 (token 1 twice)
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25)
    mask = torch.tensor([True, False, False, True, False, False])
    got = apply_penalties(LOGITS, mask, [1, 1, 4], params)
    expected = [
        2.0 / 1.5,  # in the prompt, positive: divided
        -1.0 * 1.5 - 2 * 0.5 - 0.25,  # output twice, negative: multiplied, then 2 x freq + pres
        0.5,  # never seen
        -0.5 * 1.5,  # in the prompt, negative: multiplied; not in the output
        1.0 / 1.5 - 0.5 - 0.25,  # output once
        3.0,  # never seen
    ]
    assert got.tolist() == pytest.approx(expected)


def test_presence_and_frequency_count_only_output_tokens():
    params = SamplingParams(frequency_penalty=1.0, presence_penalty=1.0)
    got = apply_penalties(LOGITS, None, [], params)  # prompt tokens 0 and 3 are not penalized
    assert got.tolist() == LOGITS.tolist()


def test_greedy_takes_the_argmax_after_penalties():
    # 5 is the raw argmax (3.0); after it appeared twice with frequency 1.5: 3 - 3 = 0 < 2.0
    plain = request(output=[5, 5], ignore_eos=True)
    penalized = request(output=[5, 5], ignore_eos=True, frequency_penalty=1.5)
    assert sample([plain, penalized]).tokens == [5, 0]


def test_a_sampled_request_applies_penalties_before_temperature():
    params = dict(temperature=0.7, seed=3, repetition_penalty=1.8, presence_penalty=0.5)
    r = request(output=[4, 2], **params)
    got = sample([r]).tokens[0]
    # by hand: prompt {0, 3}, output {2, 4}; then / 0.7, softmax, one draw from a fresh seed 3
    # (the exponential race: the argmax of the probabilities over Exp(1) noise)
    penalized = torch.tensor([2.0 / 1.8, -1.0, 0.5 / 1.8 - 0.5, -0.5 * 1.8, 1.0 / 1.8 - 0.5, 3.0])
    probs = torch.softmax(penalized / 0.7, dim=-1)
    noise = torch.empty(6).exponential_(generator=torch.Generator().manual_seed(3))
    assert got == int((probs / noise).argmax())


def test_the_prompt_tokens_are_marked_once_per_request_and_dropped_with_it():
    sampler = Sampler(torch.device("cpu"), eos_token_ids=(EOS,))
    r = request(repetition_penalty=1.2)
    sampler.sample(LOGITS[None], [r])
    counts = sampler.logits_processor.output_counts
    slot = counts.rows["r"].slot
    assert counts.prompt[slot].tolist() == [True, False, False, True, False, False]
    sampler.sample(LOGITS[None], [r])
    assert counts.rows["r"].slot == slot
    sampler.drop("r")
    assert counts.rows == {} and counts.free[-1] == slot


# ---- min_tokens --------------------------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    # raw order: 5 (EOS), 0, 4, 2, 3, 1; stop token 0
    early = request(output=[1], min_tokens=3, stop_token_ids=[0])
    reached = request(output=[1, 1, 1], min_tokens=3, stop_token_ids=[0], request_id="s")
    assert sample([early, reached]).tokens == [4, 5]


def test_min_tokens_leaves_eos_alone_when_eos_is_ignored():
    r = request(output=[1], min_tokens=3, ignore_eos=True)
    assert sample([r]).tokens == [5]


# ---- log-probabilities -------------------------------------------------------------------------


def test_logprobs_are_the_raw_log_softmax_with_the_top_k_and_the_sampled_rank():
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    top2 = request(logprobs=2, ignore_eos=True)
    only_sampled = request(logprobs=0, ignore_eos=True, request_id="s")
    out = sample([top2, only_sampled], logits)
    ref = torch.log_softmax(logits, dim=-1)
    a, b = out.logprobs
    assert a is not None and b is not None
    assert (a.token_id, a.rank, a.top_token_ids) == (5, 1, (5, 0))
    assert a.logprob == pytest.approx(ref[0, 5].item())
    assert a.top_logprobs == pytest.approx([ref[0, 5].item(), ref[0, 0].item()])
    assert (b.token_id, b.rank, b.top_token_ids, b.top_logprobs) == (0, 1, (), ())
    assert b.logprob == pytest.approx(ref[1, 0].item())
    assert math.isclose(sum(math.exp(v) for v in ref[0].tolist()), 1.0, rel_tol=1e-6)


def test_logprobs_ignore_penalties_and_rank_the_sampled_token_in_the_raw_order():
    # the penalty moves the choice from 5 to 0; its log-probability and rank stay the raw ones
    r = request(output=[5, 5], ignore_eos=True, frequency_penalty=1.5, logprobs=1)
    (lp,) = sample([r]).logprobs
    ref = torch.log_softmax(LOGITS, dim=-1)
    assert lp is not None and (lp.token_id, lp.rank, lp.top_token_ids) == (0, 2, (5,))
    assert lp.logprob == pytest.approx(ref[0].item())


def test_rows_without_logprobs_get_none():
    assert sample([request()]).logprobs == [None]
