"""The vocabulary-parallel pieces of a shard, in one process: each rank's embedding rows and
LM-head rows, summed or concatenated over the ranks, give the full model's (the spawned-rank
tests in `tests/runner/test_tensor_parallel.py` check whole models)."""

from __future__ import annotations

import attrs
import pytest
import torch

from unified_attn.backends.reference import ReferenceAttentionBackend
from unified_attn.models import DecoderModel, get_preset
from unified_attn.models.tensor_parallel import shard_decoder, shard_plan


def full_model(vocab_size: int, tie: bool) -> DecoderModel:
    config = attrs.evolve(
        get_preset("tiny-llama"),
        vocab_size=vocab_size,
        tie_word_embeddings=tie,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = DecoderModel(config, ReferenceAttentionBackend)
    model.init_random_weights(0)
    return model


def shards(full: DecoderModel, world: int) -> list[DecoderModel]:
    """The ranks' shards with collectives that do nothing: each rank's partial results."""
    return [
        shard_decoder(full, r, world, lambda t: None, lambda t: t, ReferenceAttentionBackend)
        for r in range(world)
    ]


@pytest.mark.parametrize("vocab, world", [(384, 2), (301, 2), (301, 4), (7, 4)])
@pytest.mark.parametrize("tie", [False, True])
def test_vocabulary_rows_add_up_to_the_full_model(vocab, world, tie):
    full = full_model(vocab, tie)
    ranks = shards(full, world)
    local = shard_plan(full.config, 0, world).vocab_size
    assert local * world >= vocab > local * (world - 1)
    ids = torch.tensor([0, 1, vocab // 2, vocab - 1, local - 1, local])
    ids = ids[ids < vocab]
    embedded = sum(m.model.embed_tokens(ids) for m in ranks)
    torch.testing.assert_close(embedded, full.model.embed_tokens(ids), rtol=0, atol=0)
    hidden = torch.randn(3, full.config.hidden_size)
    # each rank's logits are its own vocabulary rows; the gather (here: concatenation in rank
    # order, cut to the vocabulary) gives the full logits
    parts = [m.compute_logits(hidden) for m in ranks]
    assert all(p.shape == (3, local) for p in parts)
    joined = torch.cat(parts, dim=-1)[:, :vocab]
    # (the same dot products; a matmul of other row counts may round differently)
    torch.testing.assert_close(joined, full.compute_logits(hidden), rtol=1e-6, atol=1e-6)


def test_padding_rows_are_zero():
    full = full_model(301, tie=False)
    last = shards(full, 4)[3]
    head = last.lm_head
    assert head is not None
    start = shard_plan(full.config, 3, 4).vocab_start
    assert torch.equal(head.weight[: 301 - start], full.lm_head.weight[start:])  # type: ignore[union-attr]
    assert not head.weight[301 - start :].any()
