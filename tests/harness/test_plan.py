"""Memory planning: hybrid capacity against full allocation at real-model shapes."""

import pytest

from unified_attn.harness.plan import REAL_SHAPES, all_full, capacity, compare

GIB = 2**30


@pytest.mark.parametrize(
    "name, max_model_len",
    [("gpt-oss-20b", 32768), ("gemma2-9b", 32768), ("llama4-scout", 131072)],
)
def test_capacity_reaches_ninety_percent_of_the_theoretical_gain(name, max_model_len):
    result = compare(REAL_SHAPES[name], 40 * GIB, max_model_len, max_in_flight_tokens=2048)
    assert result["theoretical_ratio"] > 1.4
    assert result["fraction_of_theoretical_gain"] >= 0.9


def test_full_allocation_has_one_group_and_the_expected_capacity():
    config = all_full(REAL_SHAPES["gpt-oss-20b"])
    cap = capacity(config, 10 * GIB, 32768)
    (group,) = cap.plan.groups
    assert len(group.layers) == 24
    page = 2 * 16 * 8 * 64 * 2  # K+V, 16 tokens, 8 KV heads, head 64, bf16
    assert cap.plan.bytes_per_block == 24 * page
    assert cap.num_blocks == 10 * GIB // (24 * page) - 1
    assert cap.blocks_per_request == (2048,)


def test_alternating_layers_form_two_equal_groups_aliasing_one_buffer():
    cap = capacity(REAL_SHAPES["gemma2-9b"], 10 * GIB, 32768, max_in_flight_tokens=2048)
    assert [len(g.layers) for g in cap.plan.groups] == [21, 21]
    assert cap.plan.wasted_bytes_per_block() == [0, 0]


def test_plan_command_json(capsys):
    import json

    from unified_attn.cli import main

    argv = ["plan", "--model", "gemma2-like", "--kv-cache-memory", "64MiB", "--max-model-len",
            "2048", "--max-num-batched-tokens", "64", "--json"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["capacity_ratio"] > 1.0
    assert [g["manager"] for g in report["hybrid"]["groups"]] == [
        "SlidingWindowManager",
        "FullAttentionManager",
    ]


def test_plan_command_rejects_unknown_models(capsys):
    from unified_attn.cli import main

    assert main(["plan", "--model", "no-such-model"]) == 2
    assert "real-model shape" in capsys.readouterr().err
