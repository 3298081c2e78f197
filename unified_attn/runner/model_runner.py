"""The model runner: a step's inputs (types in `runner/step_inputs.py`), one
`CommonAttentionMetadata`, the flat `prep_forward` loop, the model forward and sampling."""

from __future__ import annotations

import itertools
from typing import Any

import attrs
import numpy as np
import torch

from unified_attn.backend import CommonAttentionMetadata
from unified_attn.runner.cuda_graphs import DecodeGraphs
from unified_attn.runner.device import pinned_to
from unified_attn.runner.logits_processing import reads_outputs
from unified_attn.runner.logprobs import TokenLogprobs, token_logprobs
from unified_attn.runner.overlap import DeviceTokens, PendingStep, draw_along, with_tokens_in_flight
from unified_attn.runner.runner_groups import (
    backend_group_ids,
    cross_group_ids,
    encoder_limits,
    no_cache_backends,
)
from unified_attn.runner.sampler import Sampler
from unified_attn.runner.scheduler import ScheduledRequest, SchedulerOutput
from unified_attn.runner.step_inputs import (
    BlockTables,
    EncoderInputs,
    HostLayout,
    StepInputs,
    StepResult,
    encoder_metadata,
)
from unified_attn.runner.worker import KVCachePlan


class ModelRunner:
    """Turns a `SchedulerOutput` into tensors and runs the model.

    Per step: update the persistent block tables, lay the scheduled tokens out
    (`prepare_inputs` -> `StepInputs`), run every backend's `prep_forward` once (the flat
    loop), the model forward, and sampling. Decode steps replay CUDA graphs when every backend
    supports them.
    """

    def __init__(
        self,
        model: Any,
        plan: KVCachePlan,
        *,
        device: torch.device | str,
        max_num_seqs: int,
        max_model_len: int,
        seed: int = 0,
        cuda_graphs: bool = False,
        eos_token_ids: tuple[int, ...] = (),
        graph_query_lens: tuple[int, ...] = (1,),
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        self.block_sizes = [g.block_size for g in plan.groups]
        # cross-attention groups: their slot mappings cover encoder tokens, not decoder tokens
        self.cross_gids = cross_group_ids(plan)
        self.encoder_backends = no_cache_backends(model)
        max_tokens = max([max_model_len] + [n for n in encoder_limits(plan)])
        self.block_tables = BlockTables(self.block_sizes, max_num_seqs, max_tokens)
        self.backend_groups = backend_group_ids(plan)
        invariant = getattr(model, "batch_invariant", False)
        self.sampler = Sampler(self.device, seed, eos_token_ids, batch_invariant=invariant)
        self.graphs: DecodeGraphs | None = None
        self.device_tokens = DeviceTokens.none()
        graphs_supported = (
            bool(self.backend_groups)
            and not self.cross_gids
            and all(type(b).supports_cuda_graphs() for b, _ in self.backend_groups)
        )
        if cuda_graphs and self.device.type == "cuda" and graphs_supported:
            widths = [t.shape[1] for t in self.block_tables.tables]
            self.graphs = DecodeGraphs(
                model,
                self.backend_groups,
                widths,
                self.block_sizes,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                device=self.device,
                # tokens per request of the captured steps: 1, and 1 + k to verify k drafts
                query_lens=graph_query_lens,
            )
            self.graphs.capture()

    def execute(self, output: SchedulerOutput, sample: bool = True) -> StepResult:
        """Run one step: sampled tokens of requests that reached their end, and what they asked
        for through `SamplingParams.logprobs`, `prompt_logits` and `return_logits`. With
        `sample=False` (tensor-parallel ranks other than 0, whose tokens are not used) the
        forward runs, with its collectives, and only the random draws of rank 0's sampling are
        made (`overlap.draw_along`), nothing is read back."""
        self._drop_finished(output)
        self.device_tokens = DeviceTokens.none()  # a plain step feeds no placeholder
        result = StepResult()
        if not output.scheduled:
            return result
        inputs = self.prepare_inputs(output)
        logits = self._logits(output, inputs, result)
        if logits is not None and sample:
            self._sample(output, logits, result)
        elif logits is not None:  # rank 0 samples; this rank keeps its generators in step
            draw_along(self.sampler, output, logits)
        return result

    def launch(self, output: SchedulerOutput, to_host: bool = True) -> PendingStep:
        """Run a step without waiting for it: the forward and the sampling are queued on the
        device, the sampled ids stay there for the next step's inputs (`DeviceTokens`) and, with
        `to_host` (not on tensor-parallel ranks other than 0), start their way to the host with
        the log-probabilities rows ask for (`PendingStep.result()` waits for them). For steps
        without prompt or sample logits or drafts (`step_loop.overlappable`), whose tokens are
        `execute`'s: requests reading their outputs see the token in flight."""
        self._drop_finished(output)
        pending = PendingStep(output)
        if not output.scheduled:
            return pending
        inputs = self.prepare_inputs(output)
        logits = self._logits(output, inputs, StepResult())
        if logits is None:
            return pending
        requests = [s.request for s in output.scheduled if s.will_sample]
        if len(requests) != len(logits):
            raise ValueError("launch: a step with draft tokens cannot overlap; use execute")
        readers = [r for r in requests if reads_outputs(r)]
        seen = with_tokens_in_flight(requests, readers, self.device_tokens)
        ids = self.sampler.sample_ids(logits, seen)
        pending.request_ids = [r.request_id for r in requests]
        if to_host:
            pending.logprobs = self.sampler.step_logprobs(logits, ids, requests)
        tokens = DeviceTokens.of_step(ids, requests, to_host, bool(readers), pending.logprobs)
        pending.copy, self.device_tokens = tokens.host if to_host else None, tokens
        return pending

    def _drop_finished(self, output: SchedulerOutput) -> None:
        preempted = {r.request_id for r in output.preempted}
        for request_id in output.finished_ids:
            self.block_tables.drop(request_id)
            if request_id not in preempted:  # a preempted request resumes its random stream
                self.sampler.drop(request_id)

    def greedy_tokens(
        self, output: SchedulerOutput, input_ids: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """A draft model's forward: the argmax token of every sampled row, left on the device
        (no host sync; None when no request samples), with the step's token ids replaced by
        `input_ids` (device) if given, so a forward can feed on the previous one's tokens
        before they reach the host."""
        inputs = self.prepare_inputs(output)
        if input_ids is not None:
            inputs = attrs.evolve(inputs, input_ids=input_ids)
        logits = self._logits(output, inputs, StepResult())
        return None if logits is None else logits.argmax(dim=-1)

    def _logits(
        self, output: SchedulerOutput, inputs: StepInputs, result: StepResult
    ) -> torch.Tensor | None:
        """The forward: logits of the sampled rows (None if none samples), on a captured graph
        when the step fits one; prompt logits go to `result`."""
        common = inputs.common
        if self._use_graphs(output):
            assert self.graphs is not None
            logits = self.graphs.run(inputs.input_ids, common, inputs.block_tables)
            if len(inputs.sample_rows) != len(logits):  # q tokens per request, the last sampled
                logits = logits[inputs.sample_rows]
            return logits
        with torch.inference_mode():
            encoder_hidden = self._run_encoder(inputs.encoder)
        for backend, gids in self.backend_groups:
            backend.prep_forward(common, {gid: inputs.block_tables[gid] for gid in gids})
        with torch.inference_mode():
            if self.cross_gids:
                hidden = self.model(inputs.input_ids, common.positions, encoder_hidden)
            else:
                hidden = self.model(inputs.input_ids, common.positions)
            self._collect_prompt_logits(output, common, hidden, result)
            if not inputs.sample_rows:
                return None
            rows = pinned_to(torch.tensor(inputs.sample_rows), self.device)
            return self.model.compute_logits(hidden[rows])

    def _sample(self, output: SchedulerOutput, logits: torch.Tensor, result: StepResult) -> None:
        """Sample the requests that reached their end: in one batch, except those verifying
        draft tokens (`Sampler.verify`, one request at a time)."""
        entries = [s for s in output.scheduled if s.will_sample]
        first_rows, row = [], 0
        for entry in entries:
            first_rows.append(row)
            row += 1 + len(entry.spec_token_ids)
        plain = [i for i, e in enumerate(entries) if not e.spec_token_ids]
        if plain:
            # without drafts every row is sampled: no gather (the common decode step)
            rows = logits if len(plain) == len(logits) else logits[[first_rows[i] for i in plain]]
            sampled = self.sampler.sample(rows, [entries[i].request for i in plain])
            for j, i in enumerate(plain):
                lp = sampled.logprobs[j]
                self._record(result, entries[i], [sampled.tokens[j]], [lp], rows[j : j + 1])
        for i, entry in enumerate(entries):
            if entry.spec_token_ids:
                start = first_rows[i]
                rows = logits[start : start + 1 + len(entry.spec_token_ids)]
                tokens, lps = self.sampler.verify(rows, entry.request, entry.spec_token_ids)
                self._record(result, entry, tokens, lps, rows[: len(tokens)])
                result.num_drafts[entry.request.request_id] = len(entry.spec_token_ids)

    @staticmethod
    def _record(
        result: StepResult,
        entry: ScheduledRequest,
        tokens: list[int],
        logprobs: list[TokenLogprobs | None],
        rows: torch.Tensor,
    ) -> None:
        request = entry.request
        rid = request.request_id
        result.sampled[rid] = tokens
        if request.sampling_params.logprobs is not None:
            result.logprobs[rid] = [lp for lp in logprobs if lp is not None]
        if request.sampling_params.return_logits:
            result.sample_logits[rid] = rows.cpu()

    def _run_encoder(self, encoder: EncoderInputs | None) -> torch.Tensor | None:
        """The encoder outputs `[E, hidden]` of the requests admitted this step, or None."""
        if encoder is None:
            return None
        for backend in self.encoder_backends:
            backend.prep_forward(encoder.common, {})
        return self.model.encode(encoder.input_ids, encoder.common.positions)

    @torch.inference_mode()
    def encode(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Encoder-only models: the last hidden states `[len, hidden]` of each prompt, computed
        in one packed forward (the caller keeps the batch within its token budget)."""
        common = encoder_metadata([len(p) for p in prompts], self.device)
        for backend in self.encoder_backends:
            backend.prep_forward(common, {})
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=self.device)
        hidden = self.model(ids, common.positions)
        starts = common.query_start_loc_cpu.tolist()
        return [hidden[a:b] for a, b in itertools.pairwise(starts)]

    def _use_graphs(self, output: SchedulerOutput) -> bool:
        """Decode steps that fit a captured size: every request samples (no prompt logits) and
        computes the same captured number of tokens (1, or 1 + k with k drafts each; a draft
        model's catch-up: 2, its last token and the target's bonus token)."""
        if self.graphs is None or self.graphs.bucket(len(output.scheduled)) is None:
            return False
        q = output.scheduled[0].num_new_tokens
        return q in self.graphs.query_lens and all(
            s.num_new_tokens == q
            and s.will_sample
            and not s.request.sampling_params.needs_prompt_rows
            for s in output.scheduled
        )

    def _collect_prompt_logits(self, output, common, hidden, result: StepResult) -> None:
        """The logits (`prompt_logits`) and the next prompt token's log-probabilities
        (`prompt_logprobs`, raw as the sampler's) of this step's prompt positions."""
        starts = common.query_start_loc_cpu.tolist()
        for i, entry in enumerate(output.scheduled):
            request, before = entry.request, entry.num_computed_before
            params = request.sampling_params
            if not params.needs_prompt_rows:
                continue
            end = min(before + entry.num_new_tokens, request.num_prompt_tokens)
            if end <= before:
                continue
            logits = self.model.compute_logits(hidden[starts[i] : starts[i] + end - before])
            if params.prompt_logits:
                result.prompt_logits[request.request_id] = logits.cpu()
            targets = request.prompt_token_ids[before + 1 : end + 1]  # the last has none
            if params.prompt_logprobs is not None and targets:
                rows = self.sampler.log_softmax(logits[: len(targets)].float())
                ks = [params.prompt_logprobs] * len(targets)
                result.prompt_logprobs[request.request_id] = token_logprobs(rows, targets, ks)

    def prepare_inputs(self, output: SchedulerOutput) -> StepInputs:
        """Host-side batch layout: token ids, positions, the metadata and block tables."""
        layout = self._layout(output)
        dev = self.device
        # Index math in numpy: on a small CPU each torch op costs ~10 µs, numpy's ~1 µs.
        positions = np.array(layout.positions, dtype=np.int64)
        token_rows = np.array(layout.token_rows, dtype=np.int64)
        rows = np.array(layout.rows, dtype=np.int64)
        tables, slot_mappings, host_tables = {}, {}, {}
        split = {bs: (positions // bs, positions % bs) for bs in set(self.block_sizes)}
        for gid, bs in enumerate(self.block_sizes):
            table = self.block_tables.tables_np[gid]
            block_index, block_offset = split[bs]
            slots = table[token_rows, block_index].astype(np.int64) * bs + block_offset
            slot_mappings[gid] = pinned_to(torch.from_numpy(slots), dev)
            host_tables[gid] = torch.from_numpy(table[rows])
            tables[gid] = pinned_to(host_tables[gid], dev)
        encoder = None
        encoder_lens = None
        if self.cross_gids:
            encoder, encoder_lens = self._encoder_inputs(output, rows, slot_mappings)
        qsl = torch.tensor(layout.query_start, dtype=torch.int32)
        seq_lens = torch.tensor(layout.seq_lens, dtype=torch.int32)
        drafts, columns = _speculation(output)
        common = CommonAttentionMetadata(
            query_start_loc=pinned_to(qsl, dev),
            query_start_loc_cpu=qsl,
            seq_lens=pinned_to(seq_lens, dev),
            seq_lens_cpu=seq_lens,
            num_computed_tokens_cpu=torch.tensor(layout.computed, dtype=torch.int32),
            positions=pinned_to(torch.from_numpy(positions), dev),
            num_reqs=len(layout.rows),
            num_actual_tokens=len(layout.positions),
            max_query_len=max(e.num_new_tokens for e in output.scheduled),
            max_seq_len=max(layout.seq_lens),
            slot_mappings=slot_mappings,
            block_sizes=dict(enumerate(self.block_sizes)),
            encoder_seq_lens_cpu=encoder_lens,
            encoder_seq_lens=None if encoder_lens is None else encoder_lens.to(dev),
            num_drafts_cpu=drafts,
            state_columns_cpu=columns,
            block_tables_cpu=host_tables,
        )
        input_ids = pinned_to(torch.tensor(layout.input_ids, dtype=torch.int64), dev)
        if layout.placeholders:  # tokens the previous (overlapped) step sampled on the device
            at = pinned_to(torch.tensor([i for i, _ in layout.placeholders]), dev)
            ids = self.device_tokens.gather([rid for _, rid in layout.placeholders])
            input_ids.index_copy_(0, at, ids)
        return StepInputs(common, tables, input_ids, layout.sample_rows, encoder)

    def _encoder_inputs(
        self, output: SchedulerOutput, rows: np.ndarray, slot_mappings: dict[int, torch.Tensor]
    ) -> tuple[EncoderInputs | None, torch.Tensor]:
        """The encoder pass of requests (re)starting this step, and the cross groups' slot
        mappings `[E]` (replacing the decoder-token ones): where their encoder keys go."""
        runs = [
            (i, e.request.encoder_token_ids)
            for i, e in enumerate(output.scheduled)
            if e.is_new and e.request.encoder_token_ids
        ]
        lengths = [len(ids) for _, ids in runs]
        positions = np.concatenate([np.arange(n) for n in lengths]) if runs else np.zeros(0, int)
        token_rows = np.repeat(rows[[i for i, _ in runs]], lengths)
        for gid in self.cross_gids:
            bs, table = self.block_sizes[gid], self.block_tables.tables_np[gid]
            slots = table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
            slot_mappings[gid] = torch.from_numpy(slots).to(self.device)
        encoder_lens = torch.tensor(
            [e.request.num_encoder_tokens for e in output.scheduled], dtype=torch.int32
        )
        if not runs:
            return None, encoder_lens
        ids = torch.tensor([t for _, p in runs for t in p], dtype=torch.int64, device=self.device)
        return EncoderInputs(encoder_metadata(lengths, self.device), ids), encoder_lens

    def _layout(self, output: SchedulerOutput) -> HostLayout:
        """Update the block tables and lay out the scheduled tokens, request after request."""
        layout = HostLayout()
        tables = self.block_tables
        for entry in output.scheduled:
            request = entry.request
            if entry.is_new or any(entry.block_ids):
                row = tables.update(request.request_id, entry.block_ids, entry.is_new)
            else:  # most decode steps: nothing to write into the table
                row = tables.rows[request.request_id]
            start, num_new = entry.num_computed_before, entry.num_new_tokens
            end = start + num_new
            layout.rows.append(row)
            if num_new == 1:
                layout.token_rows.append(row)
                if start < request.num_tokens:
                    layout.input_ids.append(request.all_token_ids[start])
                else:  # sampled by the step in flight: its id is still on the device
                    layout.placeholders.append((len(layout.input_ids), request.request_id))
                    layout.input_ids.append(0)
                layout.positions.append(start)
            else:
                drafts = entry.spec_token_ids
                layout.token_rows.extend([row] * num_new)
                layout.input_ids.extend(request.all_token_ids[start : end - len(drafts)])
                layout.input_ids.extend(drafts)
                layout.positions.extend(range(start, end))
            layout.query_start.append(layout.query_start[-1] + num_new)
            layout.seq_lens.append(end)
            layout.computed.append(start)
            if entry.will_sample:  # reached its known tokens: sample (and verify the drafts)
                last = layout.query_start[-1] - 1 - len(entry.spec_token_ids)
                layout.sample_rows.extend(range(last, layout.query_start[-1]))
        return layout


def _speculation(output: SchedulerOutput) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Per request: draft tokens verified this step and the state-table column holding its
    state (`Request.state_column`); (None, None) while no request speculates."""
    drafts = [len(e.spec_token_ids) for e in output.scheduled]
    columns = [e.request.state_column for e in output.scheduled]
    if not any(drafts) and not any(columns):
        return None, None
    return torch.tensor(drafts, dtype=torch.int32), torch.tensor(columns, dtype=torch.int32)
