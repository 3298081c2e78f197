"""The typed data of one model-runner step: the inputs `ModelRunner.prepare_inputs` makes
(`StepInputs`, `EncoderInputs`, the host layout they are built from), what a step produced
(`StepResult`), the persistent per-group `BlockTables`, and `encoder_metadata`, the batch of an
encoder pass."""

from __future__ import annotations

import attrs
import torch

from unified_attn.backend import CommonAttentionMetadata
from unified_attn.runner.logprobs import TokenLogprobs
from unified_attn.utils import cdiv


@attrs.frozen
class EncoderInputs:
    """One pass of self-attention layers that keep no cache (an encoder), over whole inputs."""

    common: CommonAttentionMetadata  # the inputs packed back to back, nothing computed before
    input_ids: torch.Tensor  # device [E] int64


@attrs.frozen
class StepInputs:
    """The device inputs of one step, made by `ModelRunner.prepare_inputs`."""

    common: CommonAttentionMetadata  # the batch, shared by every backend's prep_forward
    block_tables: dict[int, torch.Tensor]  # device: group id -> [B, width] int32 block ids
    input_ids: torch.Tensor  # device [T] int64
    # host: token rows whose logits are sampled: one per sampling request, or its last token
    # and each of its draft tokens (speculative decoding), in batch order
    sample_rows: list[int]
    # Encoder-decoder models: the encoder pass of the requests admitted this step (their
    # encoder outputs become the cross-attention keys); None when no encoder runs.
    encoder: EncoderInputs | None = None


def encoder_metadata(lengths: list[int], device: torch.device) -> CommonAttentionMetadata:
    """The batch of an encoder pass: inputs of `lengths` tokens, positions from 0, no cache."""
    lens = torch.tensor(lengths, dtype=torch.int32)
    qsl = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(lens, 0)
    positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in lengths])
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device),
        query_start_loc_cpu=qsl,
        seq_lens=lens.to(device),
        seq_lens_cpu=lens,
        num_computed_tokens_cpu=torch.zeros(len(lengths), dtype=torch.int32),
        positions=positions.to(device),
        num_reqs=len(lengths),
        num_actual_tokens=int(qsl[-1]),
        max_query_len=max(lengths),
        max_seq_len=max(lengths),
        slot_mappings={},
    )


@attrs.define
class HostLayout:
    """Python lists of a step's token layout, filled request by request."""

    rows: list[int] = attrs.Factory(list)  # block-table row of each request
    token_rows: list[int] = attrs.Factory(list)  # block-table row of each token
    input_ids: list[int] = attrs.Factory(list)
    positions: list[int] = attrs.Factory(list)
    query_start: list[int] = attrs.Factory(lambda: [0])
    seq_lens: list[int] = attrs.Factory(list)
    computed: list[int] = attrs.Factory(list)
    sample_rows: list[int] = attrs.Factory(list)
    # (token index, request id): input tokens sampled by the step in flight (overlapped steps)
    placeholders: list[tuple[int, str]] = attrs.Factory(list)


@attrs.define
class StepResult:
    """What a step produced per request (host): its new tokens (one, or with speculative
    decoding the accepted drafts and one more), their log-probabilities and logits if asked
    for, and the drafts it verified."""

    sampled: dict[str, list[int]] = attrs.Factory(dict)
    # one per new token, when `SamplingParams.logprobs` is set
    logprobs: dict[str, list[TokenLogprobs]] = attrs.Factory(dict)
    prompt_logits: dict[str, torch.Tensor] = attrs.Factory(dict)  # rows of this step's prompt
    # the next prompt token's log-probability at each of this step's prompt positions
    prompt_logprobs: dict[str, list[TokenLogprobs]] = attrs.Factory(dict)
    sample_logits: dict[str, torch.Tensor] = attrs.Factory(dict)  # [new tokens, V] rows
    num_drafts: dict[str, int] = attrs.Factory(dict)  # drafts verified (speculative decoding)


class BlockTables:
    """Persistent per-group block tables `[max_num_seqs, width]` int32, one row per request.

    Rows are assigned when a request (re)starts and updated incrementally: only new block ids
    are written. Freed positions keep stale ids; kernels never read outside the window.
    """

    def __init__(self, block_sizes: list[int], max_num_seqs: int, max_model_len: int) -> None:
        self.block_sizes = block_sizes
        self.tables = [
            torch.zeros(max_num_seqs, cdiv(max_model_len, bs) + 1, dtype=torch.int32)
            for bs in block_sizes
        ]
        self.tables_np = [t.numpy() for t in self.tables]  # the same memory
        self.lengths = [[0] * max_num_seqs for _ in block_sizes]
        self.rows: dict[str, int] = {}
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))

    def drop(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is not None:
            self.free_rows.append(row)

    def update(self, request_id: str, block_ids: tuple[list[int], ...], is_new: bool) -> int:
        if is_new:
            self.drop(request_id)
            row = self.rows[request_id] = self.free_rows.pop()
            for lengths in self.lengths:
                lengths[row] = 0
        row = self.rows[request_id]
        for gid, ids in enumerate(block_ids):
            if ids:
                start = self.lengths[gid][row]
                self.tables[gid][row, start : start + len(ids)] = torch.tensor(
                    ids, dtype=torch.int32
                )
                self.lengths[gid][row] = start + len(ids)
        return row
