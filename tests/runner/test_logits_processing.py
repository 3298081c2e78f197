"""Steps 2-4 of sampling on a whole batch (`runner/logits_processing.py`): the batched ops equal
each row processed on its own, and the output counts kept on the device between steps equal
counts taken afresh, through new tokens, replaced tokens, dropped requests and growth."""

import random

import torch

from unified_attn import SamplingParams
from unified_attn.request import Request
from unified_attn.runner.logits_processing import LogitsProcessor, OutputCounts, count_tokens
from unified_attn.runner.sampler import ExtendedRequest

VOCAB = 40
EOS = 7


def request(request_id: str, prompt, output=(), **params) -> Request:
    r = Request(request_id, list(prompt), sampling_params=SamplingParams(**params))
    for token in output:
        r.append_output_token_ids(token)
    return r


def mixed_batch(rng: random.Random, size: int) -> list[Request]:
    """Requests with every option of steps 2-4 in random combinations, and some with none."""
    out = []
    for i in range(size):
        params: dict = {}
        if rng.random() < 0.5:
            params["repetition_penalty"] = rng.choice([0.8, 1.0, 1.3])
        if rng.random() < 0.5:
            params["frequency_penalty"] = rng.choice([0.0, 0.5, -0.25])
        if rng.random() < 0.4:
            params["presence_penalty"] = rng.choice([0.0, 1.0])
        if rng.random() < 0.3:
            params["min_tokens"] = rng.randint(0, 6)
            params["stop_token_ids"] = [rng.randrange(VOCAB)]
        if rng.random() < 0.3:
            params["logit_bias"] = {rng.randrange(VOCAB): rng.uniform(-5, 5) for _ in range(3)}
        if rng.random() < 0.2:
            params["allowed_token_ids"] = rng.sample(range(VOCAB), 6)
        r = request(f"r{i}", [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))],
                    [rng.randrange(VOCAB) for _ in range(rng.randint(0, 8))], **params)  # fmt: skip
        if rng.random() < 0.3:
            r.bad_words_token_ids = [[r.output_token_ids[-1], 3]] if r.output_token_ids else [[5]]
        out.append(r)
    return out


def test_a_batch_equals_each_row_processed_alone_over_many_steps():
    rng = random.Random(0)
    requests = mixed_batch(rng, 24)
    batch, alone = LogitsProcessor((EOS,)), LogitsProcessor((EOS,))
    for _ in range(6):
        logits = torch.randn(len(requests), VOCAB)
        got = batch.process(logits, requests)
        for i, r in enumerate(requests):
            want = alone.process_rows(logits[i][None].clone(), [r], counted=False)[0]
            assert torch.equal(got[i], want), (i, r.sampling_params)
        for r in requests:
            r.append_output_token_ids(rng.randrange(VOCAB))
    assert torch.equal(logits, logits.clone())  # the input is not changed


def test_a_batch_with_no_row_to_process_is_returned_as_it_is():
    logits = torch.randn(3, VOCAB)
    plain = [request(f"p{i}", [1, 2]) for i in range(3)]
    assert LogitsProcessor((EOS,)).process(logits, plain) is logits


def counts_match(table: OutputCounts, requests) -> None:
    slots = table.slots_of(requests)
    want = count_tokens([r.output_token_ids for r in requests], VOCAB, torch.device("cpu"))
    assert torch.equal(table.counts.index_select(0, slots), want)
    prompts = count_tokens([r.prompt_token_ids for r in requests], VOCAB, torch.device("cpu"))
    assert torch.equal(table.prompt.index_select(0, slots), prompts > 0)


def test_counts_follow_new_tokens_replaced_tokens_drops_and_growth():
    table = OutputCounts(VOCAB, torch.device("cpu"))
    rng = random.Random(1)
    live = [request(f"a{i}", [i, i + 1], [i]) for i in range(5)]
    counts_match(table, live)
    for step in range(12):
        if step % 4 == 1:  # a token in flight counted (3), then another kept in its place (4)
            table.slots_of([ExtendedRequest(live[0], [*live[0].output_token_ids, 3])])
            live[0].append_output_token_ids(4)
        for r in live[1:] if step % 4 == 1 else live:
            r.append_output_token_ids(rng.randrange(VOCAB))
        if step % 4 == 2:  # a request leaves; a new one may take its slot (stale rows)
            table.drop(live.pop(1).request_id)
            live.append(request(f"n{step}", [rng.randrange(VOCAB)], [rng.randrange(VOCAB)]))
        if step == 6:  # grow past the first 8 slots
            live += [request(f"g{i}", [i], [i, i]) for i in range(9)]
        counts_match(table, live)
    assert table.counts.shape[0] == 16


def test_outputs_shorter_than_counted_are_counted_again():
    table = OutputCounts(VOCAB, torch.device("cpu"))
    r = request("s", [1], [4, 5, 6])
    table.slots_of([ExtendedRequest(r, [4, 5, 6, 9, 9])])
    counts_match(table, [r])
