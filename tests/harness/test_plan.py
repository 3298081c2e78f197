"""Memory planning: hybrid capacity against full allocation at real-model shapes."""

import pytest

from unified_attn.harness.capacity import REAL_SHAPES, all_full, capacity, compare

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


def test_plan_for_a_tensor_parallel_rank_doubles_the_capacity_per_gpu(capsys):
    import json

    from unified_attn.cli import main

    reports = []
    for size in ("1", "2"):
        argv = ["plan", "--model", "tiny-llama", "--tensor-parallel-size", size, "--json"]
        assert main(argv) == 0
        reports.append(json.loads(capsys.readouterr().out))
    one, two = (r["hybrid"] for r in reports)
    assert two["bytes_per_block"] * 2 == one["bytes_per_block"]
    assert two["capacity_tokens"] == pytest.approx(2 * one["capacity_tokens"], rel=1e-3)
    assert reports[1]["settings"]["tensor_parallel_size"] == 2
    assert main(["plan", "--model", "tiny-llama", "--tensor-parallel-size", "3"]) == 2
    assert "does not divide the 4 query heads" in capsys.readouterr().err


def test_plan_command_rejects_unknown_models(capsys):
    from unified_attn.cli import main

    assert main(["plan", "--model", "no-such-model"]) == 2
    assert "real-model shape" in capsys.readouterr().err


# ---- the plan tells the truth: run's defaults, shown; no gain forced to 100% ----------------


def test_plan_takes_runs_defaults_shows_them_and_matches_what_run_allocates(capsys):
    import json

    from unified_attn import LLMEngine
    from unified_attn.cli import main

    assert main(["plan", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["settings"] == {
        "model": "tiny-llama",
        "kv_cache_memory": 64 * 2**20,
        "max_model_len": 2048,
        "max_in_flight_tokens": 512,
        "dtype": "float32",
        "device": "cpu",
        "block_size": 16,
        "tensor_parallel_size": 1,
    }
    kv = LLMEngine().kv_cache_report  # `unified-attn run`'s engine on CPU
    hybrid = report["hybrid"]
    assert hybrid["bytes_per_block"] == kv.bytes_per_block
    assert hybrid["num_blocks"] == kv.num_blocks - 1  # the null block
    assert [g["blocks_per_request"] for g in hybrid["groups"]] == list(kv.blocks_per_request)
    assert main(["plan"]) == 0
    assert "plan for tiny-llama: KV cache 64.0 MiB, max_model_len 2,048, 512 tokens" in " ".join(
        capsys.readouterr().out.split()
    )


def test_no_possible_gain_is_not_reported_as_all_of_it(capsys):
    from unified_attn.cli import main
    from unified_attn.models import get_preset

    result = compare(get_preset("tiny-llama"), 64 * 2**20, 2048)
    assert result["theoretical_ratio"] == 1.0
    assert result["fraction_of_theoretical_gain"] is None
    assert main(["plan", "--model", "tiny-llama"]) == 0
    assert "no gain is possible" in capsys.readouterr().out


def test_a_loss_is_reported_as_a_loss():
    from unified_attn.models import get_preset

    # State layers: ideally one state each, but their pages pad the attention group's blocks.
    result = compare(get_preset("hybrid-linear"), 64 * 2**20, 2048, max_in_flight_tokens=512)
    achieved, ideal = result["capacity_ratio"], result["theoretical_ratio"]
    assert ideal > 1.9
    assert result["fraction_of_theoretical_gain"] == pytest.approx((achieved - 1) / (ideal - 1))


def test_real_shapes_have_their_context_lengths():
    assert REAL_SHAPES["gpt-oss-20b"].max_position_embeddings == 131072
    assert REAL_SHAPES["gemma2-9b"].max_position_embeddings == 8192


def test_plan_for_a_deepseek_v4_rank_keeps_one_devices_caches(capsys):
    """V4's latent caches are replicated on every rank (heads split, one shared latent): a
    rank's plan has one device's groups and capacity."""
    import json

    from unified_attn.cli import main

    reports = []
    for size in ("1", "2"):
        argv = ["plan", "--model", "deepseek-v4-like", "--tensor-parallel-size", size, "--json"]
        assert main(argv) == 0
        reports.append(json.loads(capsys.readouterr().out))
    one, two = (r["hybrid"] for r in reports)
    assert two == one
    assert main(["plan", "--model", "deepseek-v4-like", "--tensor-parallel-size", "4"]) == 2
    assert "does not divide o_groups=2" in capsys.readouterr().err


def test_deepseek_v3_plans_one_latent_group_against_per_head_keys_and_values():
    from unified_attn.harness.capacity import REAL_MLA_SHAPES

    report = compare(REAL_MLA_SHAPES["deepseek-v3"], 40 * GIB, 32768)
    (group,) = report["hybrid"]["groups"]
    assert (group["manager"], group["layers"], group["block_size"]) == (
        "FullAttentionManager", 61, 16)  # fmt: skip
    assert group["page_bytes"] == 61 * 16 * (512 + 64) * 2  # one latent per token, bf16
    full = report["full"]
    assert full["bytes_per_block"] == 61 * 16 * 2 * 128 * 192 * 2  # K and V per head
    assert report["theoretical_ratio"] == 2 * 128 * 192 / 576
    assert 0.99 < report["fraction_of_theoretical_gain"] < 1.01
    fp8 = compare(REAL_MLA_SHAPES["deepseek-v3"], 40 * GIB, 32768, kv_cache_dtype="fp8")
    assert fp8["hybrid"]["bytes_per_block"] * 2 == report["hybrid"]["bytes_per_block"]


def test_plan_for_a_deepseek_v3_rank_keeps_the_whole_latent(capsys):
    """MLA's latent is replicated on every rank (heads split): a rank's latent plan is one
    device's, while the per-head comparison shrinks with the local heads."""
    import json

    from unified_attn.cli import main

    reports = []
    for size in ("1", "2"):
        argv = ["plan", "--model", "deepseek-v3-like", "--tensor-parallel-size", size, "--json"]
        assert main(argv) == 0
        reports.append(json.loads(capsys.readouterr().out))
    one, two = reports
    assert two["hybrid"] == one["hybrid"]
    assert two["full"]["bytes_per_block"] * 2 == one["full"]["bytes_per_block"]
    assert main(["plan", "--model", "deepseek-v3-like", "--tensor-parallel-size", "3"]) == 2
    assert "does not divide num_heads=4" in capsys.readouterr().err
