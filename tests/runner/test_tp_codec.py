"""The step message's binary format (`distributed/tp_codec.py`): every field round-trips, and
`decode` refuses anything malformed with a `ValueError` that names it, never another error."""

import pickle
import random
import struct

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unified_attn.distributed.tp_codec import FORMAT_VERSION, decode, encode
from unified_attn.distributed.tp_frame import STEP, frame
from unified_attn.distributed.tp_messages import Entry, NewRequest, StepMessage
from unified_attn.distributed.tp_sampling import SAMPLING_FIELDS
from unified_attn.distributed.tp_wire import Writer
from unified_attn.sampling_params import RequestOutputKind, SamplingParams

# Every field off its default (checked below), so a field the codec drops fails a round trip.
EVERY_OPTION = SamplingParams(
    n=3,
    max_tokens=200,
    min_tokens=5,
    temperature=0.7,
    top_k=-1,
    top_p=0.9,
    min_p=0.05,
    presence_penalty=-0.5,
    frequency_penalty=1.5,
    repetition_penalty=1.1,
    seed=2**63 - 1,
    stop=("\n\n", "Ende ✓"),
    stop_token_ids=(2, 70_000),
    ignore_eos=True,
    logprobs=0,
    prompt_logprobs=-1,
    logit_bias={5: -100.0, 131_072: 0.25},
    allowed_token_ids=(5, 7, 131_072),
    bad_words=("foo", "bar baz"),
    skip_special_tokens=False,
    spaces_between_special_tokens=False,
    include_stop_str_in_output=True,
    output_kind=RequestOutputKind.DELTA,
    prompt_logits=True,
    return_logits=True,
)


def full_message() -> StepMessage:
    new = [
        NewRequest("réq-0 ✓", [1, 2, 3, 150_000], EVERY_OPTION),
        NewRequest("请求-1", [9] * 40, SamplingParams()),
        NewRequest("r-2", [], None),
    ]
    entries = [
        Entry("réq-0 ✓", 4, 0, ([1, 2], [3], []), True, False, (), 0),
        Entry("请求-1", 3, 40, ([], [7], [8, 9]), False, True, (11, 12), 2),
        Entry("🙂", 1, 70_000, ([100_000], [], []), False, True, (4,), 1),
    ]
    tokens = {"请求-1": [5, 6], "🙂": [2**32 - 1]}
    return StepMessage(new, tokens, entries, ["old"], ["old", "done-ü"], launch=True)


def decode_step(n: int) -> StepMessage:
    """A decode step: one new token and one KV-cache group per request, a block every 16th."""
    entries = [
        Entry(f"req-{i}", 1, 500 + i, ([1000 + i] if i % 16 == 0 else [],), False, True, (), 0)
        for i in range(n)
    ]
    return StepMessage([], {f"req-{i}": [i + 7] for i in range(n)}, entries, [], [])


def assert_round_trips(message: StepMessage | None) -> StepMessage | None:
    got = decode(encode(message))
    assert got == message
    if got is not None:  # the types Replica relies on, not only equal values
        for entry in got.entries:
            assert type(entry[3]) is tuple and all(type(g) is list for g in entry[3])
            assert type(entry[4]) is bool and type(entry[5]) is bool
            assert type(entry[6]) is tuple
    return got


def test_every_sampling_option_is_off_its_default():
    defaults = SamplingParams()
    same = [
        f.name
        for f in attrs.fields(SamplingParams)
        if getattr(EVERY_OPTION, f.name) == getattr(defaults, f.name)
    ]
    assert same == []


def test_a_message_with_every_field_set_round_trips():
    got = assert_round_trips(full_message())
    assert got is not None and got.new[0].sampling_params == EVERY_OPTION
    assert got.new[0].sampling_params.logit_bias == {5: -100.0, 131_072: 0.25}


@pytest.mark.parametrize("n", [0, 1, 64, 256])
def test_decode_steps_round_trip(n):
    assert_round_trips(decode_step(n))


def test_stop_and_an_empty_step_round_trip():
    assert_round_trips(None)
    assert_round_trips(StepMessage([], {}, [], [], []))
    assert_round_trips(StepMessage([], {}, [], [], [], launch=True))
    assert len(encode(None)) < len(encode(StepMessage([], {}, [], [], [])))


def test_a_large_message_round_trips():
    rng = random.Random(0)
    entries = [
        Entry(
            f"request-{i}",
            rng.randint(1, 4096),
            rng.randint(0, 10**6),
            tuple(rng.sample(range(2**20), rng.randint(0, 5)) for _ in range(rng.choice([1, 3]))),
            rng.random() < 0.5,
            rng.random() < 0.5,
            tuple(rng.randint(0, 2**17) for _ in range(rng.randint(0, 4))),
            rng.randint(0, 7),
        )
        for i in range(1000)
    ]
    tokens = {
        e[0]: [rng.randint(0, 2**17) for _ in range(rng.randint(1, 20))] for e in entries[::3]
    }
    message = StepMessage([], tokens, entries, [e[0] for e in entries[:5]], ["x"] * 3)
    assert_round_trips(message)
    assert len(encode(message)) < len(pickle.dumps(message))


def test_ids_holding_a_nul_round_trip():
    """A NUL in a string cannot join the strings; they then travel with their lengths."""
    message = StepMessage(
        [], {"a\0b": [1]}, [Entry("a\0b", 1, 0, ([],), False, True, (), 0)], ["\0"], [""]
    )
    assert_round_trips(message)


entry_strategy = st.tuples(
    st.text(max_size=6),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**32 - 1),
    st.lists(st.lists(st.integers(0, 2**32 - 1), max_size=3), max_size=3).map(tuple),
    st.booleans(),
    st.booleans(),
    st.lists(st.integers(0, 2**32 - 1), max_size=3).map(tuple),
    st.integers(0, 2**32 - 1),
)


@settings(max_examples=60, deadline=None)
@given(
    entries=st.lists(entry_strategy, max_size=8),
    tokens=st.dictionaries(
        st.text(max_size=4), st.lists(st.integers(0, 2**32 - 1), max_size=4), max_size=4
    ),
    ids=st.lists(st.text(max_size=4), max_size=3),
    launch=st.booleans(),
)
def test_any_message_round_trips(entries, tokens, ids, launch):
    assert_round_trips(StepMessage([], tokens, entries, ids, ids[::-1], launch))


# ---- SamplingParams: the codec's field list is the class's --------------------------------------


def test_the_codec_encodes_exactly_the_fields_of_sampling_params():
    assert sorted(name for name, _ in SAMPLING_FIELDS) == sorted(
        f.name for f in attrs.fields(SamplingParams)
    )


def test_a_sampling_params_field_without_an_encoding_fails_the_encoder():
    @attrs.frozen(kw_only=True)
    class WithNewField(SamplingParams):
        typical_p: float = 1.0

    message = StepMessage([NewRequest("r", [1], WithNewField())], {}, [], [], [])
    with pytest.raises(ValueError, match=r"fields \['typical_p'\] have no encoding; add each"):
        encode(message)


# ---- the encoder refuses what the format cannot hold --------------------------------------------


@pytest.mark.parametrize(
    "entry, message",
    [
        (
            Entry("r", 1, 0, ([-1],), False, True, (), 0),
            r"block ids: expected ints in \[0, 4294967295\], got -1",
        ),
        (
            Entry("r", 1, 2**32, ([],), False, True, (), 0),
            "entry num_computed_before: expected ints",
        ),
        (Entry("r", 1, 0, ([],), 2, True, (), 0), "entry is_new: expected True or False, got 2"),
        (
            Entry("r", 1, 0, ([],), False, True, (None,), 0),
            "spec token ids: expected ints .* got None",
        ),
        (
            Entry(7, 1, 0, ([],), False, True, (), 0),
            "entry request ids: expected UTF-8 strings, got 7",
        ),
        (Entry("\ud800", 1, 0, ([],), False, True, (), 0), "entry request ids: expected UTF-8"),
        (("r", 1, 0), "expected tuples of the 8 `Entry` fields"),
    ],
)
def test_the_encoder_names_a_field_it_cannot_hold(entry, message):
    with pytest.raises(ValueError, match=message):
        encode(StepMessage([], {}, [entry], [], []))


# ---- decode refuses anything malformed -----------------------------------------------------

# where each header field sits (`tp_frame._HEADER`: "<4sHHQIIIIBBH")
FIELD_OFFSETS = {
    "version": (4, "<H"),
    "kind": (6, "<H"),
    "total": (8, "<Q"),
    "num_uints": (16, "<I"),
    "num_strings": (20, "<I"),
    "width": (32, "<B"),
    "text_mode": (33, "<B"),
    "reserved": (34, "<H"),
}


def patched(data: bytes, field: str, value: int) -> bytes:
    offset, fmt = FIELD_OFFSETS[field]
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


def framed(write) -> bytes:
    """A step whose streams `write` fills by hand, to build what `encode` never would."""
    out = Writer()
    write(out)
    return frame(STEP, out)


def valid_streams(out: Writer) -> None:
    """The streams of an empty step."""
    out.strings([], "new")
    out.strings([], "entries")
    for _ in range(7):  # the entry columns
        out.column([], "column")
    for _ in range(3):  # block id counts, block ids, spec token ids
        out.uints([], "uints")
    out.flag(True, "token ids are the entries'")
    out.column([], "token counts")
    out.uints([], "token ids")
    out.strings([], "preempted")
    out.strings([], "finished")
    out.flag(False, "launch")


def test_the_hand_built_empty_step_is_valid():
    assert decode(framed(valid_streams)) == StepMessage([], {}, [], [], [])


DATA = encode(full_message())


@pytest.mark.parametrize(
    "data, message",
    [
        (pickle.dumps(full_message()), "bad magic .* expected b'UATP'"),
        (b"", "truncated: 0 bytes, expected a header"),
        # version 1, before the `launch` byte: a rank of another unified_attn is refused
        (patched(DATA, "version", 1), f"unknown format version 1, expected {FORMAT_VERSION}"),
        (patched(DATA, "version", 3), f"unknown format version 3, expected {FORMAT_VERSION}"),
        (DATA[:20], "truncated: 20 bytes, the header alone needs 36"),
        (DATA[:-1], f"truncated: the header declares {len(DATA)} bytes, the buffer holds"),
        (DATA + b"\0", "1 trailing bytes after the .* the header declares"),
        (
            patched(DATA + b"\0", "total", len(DATA) + 1),
            "length mismatch: the header's stream sizes add up",
        ),
        (patched(DATA, "num_uints", 2**32 - 1), "length mismatch"),
        (patched(DATA, "kind", 9), r"header kind 9, expected one of \(0, 1\)"),
        (patched(DATA, "width", 3), r"header uint width 3, expected one of \(1, 2, 4\)"),
        (patched(DATA, "text_mode", 2), r"header text mode 2, expected one of \(0, 1\)"),
        (patched(DATA, "reserved", 1), r"header reserved 1, expected one of \(0,\)"),
        (
            patched(DATA, "num_strings", 3),
            r"the strings \(joined by NUL\): length mismatch: \d+ found, expected 3",
        ),
        (
            DATA.replace("请求-1".encode(), b"\xff" * len("请求-1".encode()), 1),
            "invalid UTF-8 at byte",
        ),
    ],
)
def test_malformed_bytes_are_refused_with_what_was_expected(data, message):
    with pytest.raises(ValueError, match=message):
        decode(data)


def count_exceeding(out: Writer) -> None:
    out.strings([], "new")
    out.uint_stream[-1] = 1000


def uints_exceeding(out: Writer) -> None:
    out.strings(["r"], "new")
    out.uints([1, 2], "prompt")
    out.uint_stream[-3] = 5000  # the prompt's count


def extra_values(out: Writer) -> None:
    valid_streams(out)
    out.uints([1], "extra")


def bad_flag_column(out: Writer) -> None:
    out.strings([], "new")
    out.strings(["a", "b"], "entries")
    out.column([1, 1], "num_new_tokens")
    out.column([0, 1], "num_computed_before")
    out.column([0, 0], "state_column")
    out.column([0, 2], "is_new")


def bad_column_kind(out: Writer) -> None:
    out.strings([], "new")
    out.strings(["a"], "entries")
    out.uint_stream.append(7)


def bad_presence_byte(out: Writer) -> None:
    out.strings(["r"], "new")
    out.uints([1], "prompt")
    out.scalars.append(b"\x02")


def bad_sampling_value(out: Writer) -> None:
    out.strings(["r"], "new")
    out.uints([1], "prompt")
    out.flag(True, "present")
    for name, kind in SAMPLING_FIELDS:
        value = getattr(SamplingParams(), name)
        kind.write(out, -0.5 if name == "temperature" else value, name)


def truncated_scalars(out: Writer) -> None:
    out.strings(["r"], "new")
    out.uints([1], "prompt")
    out.flag(True, "present")


def version_1_step(out: Writer) -> None:
    """An empty step as format 1 wrote it: no `launch` byte."""
    valid_streams(out)
    out.scalars.pop()


def bad_launch_byte(out: Writer) -> None:
    valid_streams(out)
    out.scalars[-1] = b"\x02"


def block_counts_mismatch(out: Writer) -> None:
    out.strings([], "new")
    out.strings(["a"], "entries")
    for value in (1, 0, 0, 0, 1, 2, 0):  # two KV-cache groups
        out.column([value], "column")
    out.uints([0], "block id counts")  # one count, expected two


@pytest.mark.parametrize(
    "write, message",
    [
        (count_exceeding, "new request ids: count 1000 exceeds the 0 strings left"),
        (uints_exceeding, "prompt token ids: count 5000 exceeds the 2 uints left"),
        (extra_values, r"trailing values after the last field \(2 uints\), expected none"),
        (bad_flag_column, "is_new: flag 2, expected 0 or 1"),
        (bad_column_kind, "column kind 7, expected 0 .* or 1"),
        (bad_presence_byte, "flag byte 2, expected 0 or 1"),
        (bad_sampling_value, "new request 'r': sampling parameters refused: .*temperature"),
        (
            truncated_scalars,
            "truncated: sampling parameter n needs 8 scalar bytes at offset 1, 0 left",
        ),
        (block_counts_mismatch, "block id counts .* length mismatch: 1 found, expected 2"),
        (version_1_step, "truncated: launch needs 1 scalar bytes at offset 1, 0 left"),
        (bad_launch_byte, "launch: flag byte 2, expected 0 or 1"),
    ],
)
def test_malformed_streams_are_refused_with_what_was_expected(write, message):
    with pytest.raises(ValueError, match=message):
        decode(framed(write))


def test_every_truncation_and_every_flipped_byte_is_refused_or_read_never_crashes():
    """Any prefix is refused; a flipped byte is refused with a ValueError, or (a changed
    value) read as some other well-formed message: never another exception, never a partial
    message."""
    for end in range(len(DATA)):
        with pytest.raises(ValueError):
            decode(DATA[:end])
    for at in range(len(DATA)):
        for flip in (0x01, 0x80, 0xFF):
            data = bytearray(DATA)
            data[at] ^= flip
            try:
                got = decode(bytes(data))
            except ValueError:
                continue
            assert isinstance(got, StepMessage) or got is None
