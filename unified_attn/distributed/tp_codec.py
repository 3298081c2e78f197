"""The step message in bytes: a typed, versioned binary format, never pickle.

Rank 0 `encode`s each `StepMessage` (or None: stop) and the other ranks `decode` it from the
control group, whose port anything on the network may reach under torchrun. `decode` reads only
the fields below, into ints, bools and strings (and the sampling parameters' floats), and
refuses anything else with a `ValueError` naming what is wrong and what was expected; it never
executes anything and never returns a partial message.

The bytes are a header and three streams (`distributed/tp_frame.py`: uints, strings, scalars).
The fields, in order (a count is a uint; a column is N uints after a 1, or a 0 and one uint
that fills all N rows):

    new        request ids (count, strings); per request: prompt token ids (count, uints),
               sampling parameters (`distributed/tp_sampling.py`)
    entries    request ids (count N, strings) | columns num_new_tokens, num_computed_before,
               state_column, is_new, will_sample, KV-cache groups, spec tokens |
               block count of each group (count, uints) | block ids (count, uints) |
               spec token ids (count, uints)
    tokens     scalar byte 1: the entries' request ids (0: count, strings) |
               column of token counts | token ids (count, uints)
    preempted  request ids (count, strings)
    finished   request ids (count, strings)
    launch     scalar byte 1: rank 0 launched the step overlapped (`StepMessage.launch`), 0: it
               ran it plainly (new in format version 2)

A stop message is the header alone. A change to the layout, or to the fields of
`SamplingParams` (which `encode` checks against `tp_sampling.SAMPLING_FIELDS`), is a new
`FORMAT_VERSION`.

Cost (CPU time, `timeit`, best of 15, on the 2-core CPU VM while other jobs ran), for a decode
step (one new token and one KV-cache group per request, a new block every 16th):

    entries  encode + decode       pickle (before)       bytes (pickle)
    64       34 + 35 µs             17 + 22 µs            912 (2,701)
    256      104 + 98 µs            60 + 84 µs            3,588 (10,748)

Pickle's C loop does one pass per object; here a few C passes per column (`zip`, `map`,
`array`) and a Python call per field add about 30 µs to a 64-entry step, against the ~400 µs
its broadcast takes. The bytes are 3x fewer, so larger steps stay within the one fixed-size
broadcast (`MESSAGE_BYTES`).
"""

from __future__ import annotations

from itertools import chain, islice
from typing import Any

from unified_attn.distributed.tp_frame import FORMAT_VERSION, STEP, STOP, frame, unframe
from unified_attn.distributed.tp_messages import Entry, NewRequest, StepMessage
from unified_attn.distributed.tp_sampling import read_sampling_params, write_sampling_params
from unified_attn.distributed.tp_wire import (
    Reader,
    Writer,
    check_length,
    is_constant,
    split,
    split_lists,
)

__all__ = ["FORMAT_VERSION", "decode", "encode"]

_ENTRY_COLUMNS = (
    "entry num_new_tokens",
    "entry num_computed_before",
    "entry state_column",
    "entry is_new",
    "entry will_sample",
    "entry KV-cache group count",
    "entry spec token count",
)


def encode(message: StepMessage | None) -> bytes:
    """`message` (None: the ranks stop) in format `FORMAT_VERSION`; a field of the wrong type
    or out of range raises `ValueError` naming it."""
    out = Writer()
    if message is not None:
        _write_new(out, message.new)
        entry_ids = _write_entries(out, message.entries)
        _write_tokens(out, message.tokens, entry_ids)
        out.strings(message.preempted_ids, "preempted ids")
        out.strings(message.finished_ids, "finished ids")
        out.flag(message.launch, "launch")
    return frame(STOP if message is None else STEP, out)


def decode(data: bytes | bytearray | memoryview) -> StepMessage | None:
    """The message `encode` made, or `ValueError` for anything malformed."""
    kind, reader = unframe(data)
    message = None if kind == STOP else _read_step(reader)
    reader.finish()
    return message


def _read_step(data: Reader) -> StepMessage:
    new = _read_new(data)
    entry_ids, entries = _read_entries(data)
    tokens = _read_tokens(data, entry_ids)
    preempted = data.strings("preempted ids")
    finished = data.strings("finished ids")
    return StepMessage(new, tokens, entries, preempted, finished, data.flag("launch"))


def _write_new(out: Writer, new: list[NewRequest]) -> None:
    out.strings([request.request_id for request in new], "new request ids")
    for request in new:
        out.uints(request.prompt_token_ids, "prompt token ids")
        write_sampling_params(out, request.sampling_params)


def _read_new(data: Reader) -> list[NewRequest]:
    ids = data.strings("new request ids")
    return [
        NewRequest(rid, data.uints("prompt token ids"), read_sampling_params(data, rid))
        for rid in ids
    ]


def _entry_columns(entries: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """[N entries of `Entry` fields] -> [one tuple per field, N long]."""
    fields = len(Entry._fields)
    try:
        columns = list(zip(*entries, strict=True)) if entries else [()] * fields
    except (TypeError, ValueError):
        columns = []
    if len(columns) != fields:
        raise ValueError(
            f"step message: entries: expected tuples of the {fields} `Entry` fields "
            f"({', '.join(Entry._fields)}), got {entries[:1]!r} ..."
        )
    return columns


def _write_entries(out: Writer, entries: list[tuple[Any, ...]]) -> tuple[str, ...]:
    rids, new_tokens, computed, blocks, is_new, will_sample, spec, state = _entry_columns(entries)
    out.strings(rids, "entry request ids")
    num_groups = tuple(map(len, blocks))
    num_spec = tuple(map(len, spec)) if any(spec) else (0,) * len(spec)
    for column, what in zip((new_tokens, computed, state), _ENTRY_COLUMNS[:3], strict=True):
        out.column(column, what)
    out.flags(is_new, _ENTRY_COLUMNS[3])
    out.flags(will_sample, _ENTRY_COLUMNS[4])
    out.column(num_groups, _ENTRY_COLUMNS[5])
    out.column(num_spec, _ENTRY_COLUMNS[6])
    groups = list(chain.from_iterable(blocks))
    out.uints(map(len, groups), "block id counts")
    out.uints(chain.from_iterable(groups), "block ids")
    out.uints(chain.from_iterable(spec), "spec token ids")
    return rids


def _read_entries(data: Reader) -> tuple[list[str], list[tuple[Any, ...]]]:
    rids = data.strings("entry request ids")
    n = len(rids)
    new_tokens, computed, state = (data.column(n, what) for what in _ENTRY_COLUMNS[:3])
    is_new, will_sample = (data.flags(n, what) for what in _ENTRY_COLUMNS[3:5])
    num_groups, num_spec = (data.column(n, what) for what in _ENTRY_COLUMNS[5:])
    group_lengths = data.uints("block id counts")
    check_length(group_lengths, sum(num_groups), "block id counts (one per KV-cache group)")
    block_ids = data.uints("block ids")
    check_length(block_ids, sum(group_lengths), "block ids")
    spec_ids = data.uints("spec token ids")
    check_length(spec_ids, sum(num_spec), "spec token ids")
    blocks = _block_tuples(split_lists(block_ids, group_lengths), num_groups)
    spec = _spec_tuples(spec_ids, num_spec)
    entries = zip(rids, new_tokens, computed, blocks, is_new, will_sample, spec, state, strict=True)
    return rids, list(entries)


def _block_tuples(groups: list[list[int]], num_groups: list[int]) -> list[tuple[list[int], ...]]:
    """One tuple of `num_groups[i]` block-id lists per entry; built in C when every entry has
    the same number of KV-cache groups (always, in a step of one model)."""
    if is_constant(num_groups):
        k = num_groups[0]
        return list(zip(*[iter(groups)] * k, strict=True)) if k else [()] * len(num_groups)
    rest = iter(groups)
    return [tuple(islice(rest, k)) for k in num_groups]


def _spec_tuples(flat: list[int], counts: list[int]) -> list[tuple[int, ...]]:
    if not flat:  # no speculation this step
        return [()] * len(counts)
    return list(map(tuple, split(flat, counts)))


def _write_tokens(out: Writer, tokens: dict[str, list[int]], entry_ids: tuple[str, ...]) -> None:
    """The tokens per request; their ids as a flag when they are the entries' (a decode step)."""
    ids = tuple(tokens)
    out.flag(ids == entry_ids, "token ids are the entries'")
    if ids != entry_ids:
        out.strings(ids, "token request ids")
    out.column(tuple(map(len, tokens.values())), "token counts")
    out.uints(chain.from_iterable(tokens.values()), "token ids")


def _read_tokens(data: Reader, entry_ids: list[str]) -> dict[str, list[int]]:
    same = data.flag("token ids are the entries'")
    ids = entry_ids if same else data.strings("token request ids")
    counts = data.column(len(ids), "token counts")
    flat = data.uints("token ids")
    check_length(flat, sum(counts), "token ids")
    tokens = dict(zip(ids, split_lists(flat, counts), strict=True))
    check_length(tokens, len(ids), "token request ids (each once)")
    return tokens
