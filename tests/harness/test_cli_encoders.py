"""`unified-attn run` on encoder-decoder (BART) and encoder-only (BERT) checkpoints: BART
generates from workload prompts read as encoder inputs, BERT encodes them with no KV cache."""

import json

import pytest

from tests.models.hf_encoder_models import make_hf_bart, make_hf_bert, save_hf_model
from unified_attn.cli import main

COMMON = ["--backend", "reference", "--prompt-ids", "0,5,6,7,2", "--num-requests", "3", "--json"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    bart = save_hf_model(make_hf_bart(seed=0), tmp_path_factory.mktemp("bart"))
    bert = save_hf_model(make_hf_bert(seed=0), tmp_path_factory.mktemp("bert"))
    return {"bart": str(bart), "bert": str(bert)}


def test_run_generates_with_bart(capsys, checkpoints):
    code = main(["run", "--model", checkpoints["bart"], "--max-tokens", "3", *COMMON])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["mode"] == "generate" and report["num_requests"] == 3
    managers = sorted(g["manager"] for g in report["kv_cache"]["groups"])
    assert managers == ["CrossAttentionManager", "FullAttentionManager"]
    assert report["generated_tokens"] == 9


def test_run_encodes_with_bert_and_allocates_no_cache(capsys, checkpoints):
    code = main(["run", "--model", checkpoints["bert"], *COMMON])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["mode"] == "encode"
    assert report["kv_cache"]["groups"] == [] and report["kv_cache"]["total_bytes"] == 0
    assert report["encoded_tokens"] >= 3 * 5 and report["hidden_size"] == 64
    code = main(["run", "--model", checkpoints["bert"], *COMMON[:-1]])  # the table
    assert code == 0 and "encoder-only model" in capsys.readouterr().out


def test_run_refuses_encoder_prompts_that_do_not_fit(capsys, checkpoints):
    argv = ["run", "--model", checkpoints["bart"], "--prompt-ids", ",".join(["5"] * 40)]
    code = main([*argv, "--backend", "reference"])
    err = capsys.readouterr().err
    assert code == 2 and "the model's encoder takes at most 64" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("family", ["bart", "bert"])
def test_plan_refuses_encoder_checkpoints_with_what_to_run(capsys, checkpoints, family):
    code = main(["plan", "--model", checkpoints[family]])
    err = capsys.readouterr().err
    assert code == 2 and "plan compares a decoder's layer kinds" in err
    assert f"unified-attn run --model {checkpoints[family]}" in err
