"""Log-probabilities of sampled tokens (vLLM's `logprobs`): each row's sampled token's value
and rank and the most likely tokens, computed on the device (`logprob_tensors`) and assembled on
the host (`assemble_logprobs`); a plain step does both at once (`token_logprobs`), an
overlapped step keeps the tensors (`StepLogprobs`) until its ids reach the host."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch


@attrs.frozen
class TokenLogprobs:
    """Raw log-probabilities of one sampled row: the sampled token's, its rank in the vocabulary
    (1 = the most likely; tokens with an equal log-probability count as ahead), and the
    `SamplingParams.logprobs` most likely tokens, best first."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


def logprob_tensors(
    logprobs: torch.Tensor, chosen: torch.Tensor, ks: Sequence[int]
) -> tuple[torch.Tensor, ...]:
    """On `logprobs [N, V]`'s device: the value `[N]` and rank `[N]` (1 = the most likely;
    equal values count as ahead) of each row's token `chosen [N]`, and the `max(ks)` most likely
    values and ids `[N, K]` (-1: the whole vocabulary)."""
    vocab = logprobs.shape[-1]
    chosen_lp = logprobs.gather(1, chosen[:, None])
    ranks = (logprobs >= chosen_lp).sum(dim=-1)
    top_lp, top_ids = torch.topk(logprobs, max(vocab if k == -1 else k for k in ks), dim=-1)
    return chosen_lp[:, 0], ranks, top_lp, top_ids


def assemble_logprobs(
    tokens: Sequence[int], values: Sequence[torch.Tensor], ks: Sequence[int]
) -> list[TokenLogprobs]:
    """`logprob_tensors`' values (on the host) as one `TokenLogprobs` per row."""
    chosen, ranks, top_lp, top_ids = (v.tolist() for v in values)
    out = []
    for token, value, rank, ids, lps, k in zip(
        tokens, chosen, ranks, top_ids, top_lp, ks, strict=True
    ):
        top = len(ids) if k == -1 else k
        out.append(TokenLogprobs(token, value, rank, tuple(ids[:top]), tuple(lps[:top])))
    return out


def token_logprobs(
    logprobs: torch.Tensor, tokens: Sequence[int], ks: Sequence[int]
) -> list[TokenLogprobs]:
    """Row `i` of `logprobs [N, V]`: token `tokens[i]`'s log-probability and rank, and the
    `ks[i]` most likely tokens (-1: all of them)."""
    chosen = torch.tensor(list(tokens), device=logprobs.device)
    return assemble_logprobs(tokens, logprob_tensors(logprobs, chosen, ks), ks)


@attrs.frozen
class StepLogprobs:
    """The log-probabilities an overlapped step's rows ask for, left on the device (or copied
    to the host) until its ids arrive: `rows` (indices among the step's sampled rows), each
    row's `SamplingParams.logprobs` (`ks`), and `logprob_tensors`' four tensors."""

    rows: list[int]
    ks: list[int]
    tensors: tuple[torch.Tensor, ...]

    def assemble(
        self, values: Sequence[torch.Tensor], tokens: Sequence[int]
    ) -> list[TokenLogprobs]:
        """`values` (the tensors on the host) with the step's sampled `tokens` (all rows)."""
        return assemble_logprobs([tokens[i] for i in self.rows], values, self.ks)
