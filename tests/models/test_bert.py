"""BERT (`BertEncoderModel`, `load_bert`) against transformers' `BertModel`: last hidden states
of a packed batch, checkpoint layouts, and the errors of bad configs and checkpoints."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.models.hf_encoder_models import (
    make_hf_bert,
    packed,
    prompts,
    save_hf_model,
)
from unified_attn.backend import AttentionType
from unified_attn.backends.reference import ReferenceAttentionBackend
from unified_attn.models.bert import BertConfig, BertEncoderModel
from unified_attn.models.hf_encoders import bert_config_from_hf, load_bert
from unified_attn.runner.step_inputs import encoder_metadata

LENGTHS = [7, 1, 19]


def encode(model: BertEncoderModel, batch: list[list[int]]) -> list[torch.Tensor]:
    """All prompts in one forward; per prompt its hidden states `[len, hidden]`."""
    common = encoder_metadata([len(p) for p in batch], torch.device("cpu"))
    for backend in model.backends.values():
        backend.prep_forward(common, {})
    ids, positions = packed(batch)
    return list(model(ids, positions).split([len(p) for p in batch]))


@torch.no_grad()
def hf_hidden(hf, prompt: list[int]) -> torch.Tensor:
    return hf(torch.tensor([prompt])).last_hidden_state[0]


@pytest.mark.parametrize("act", ["gelu", "gelu_new", "relu"])
def test_hidden_states_match_transformers(tmp_path, act):
    hf = make_hf_bert(hidden_act=act)
    model, tokenizer = load_bert(save_hf_model(hf, tmp_path), ReferenceAttentionBackend)
    assert tokenizer is None
    batch = prompts(LENGTHS)
    for prompt, hidden in zip(batch, encode(model, batch), strict=True):
        assert (hidden - hf_hidden(hf, prompt)).abs().max() < 1e-4


def test_task_model_checkpoint_loads_its_bert_prefix(tmp_path):
    hf = make_hf_bert(cls="BertForMaskedLM", seed=1)
    model, _ = load_bert(save_hf_model(hf, tmp_path), ReferenceAttentionBackend)
    batch = prompts(LENGTHS, seed=1)
    for prompt, hidden in zip(batch, encode(model, batch), strict=True):
        assert (hidden - hf_hidden(hf.bert, prompt)).abs().max() < 1e-4


def test_model_interface():
    config = BertConfig(
        vocab_size=32, hidden_size=16, num_layers=3, num_heads=2, intermediate_size=24
    )
    model = BertEncoderModel(config, ReferenceAttentionBackend)
    layers = list(model.attention_layers())
    assert [layer.name for layer, _ in layers] == [
        f"encoder.layer.{i}.attention.self" for i in range(3)
    ]
    assert all(backend is model.backends["encoder_only"] for _, backend in layers)
    assert {layer.attn_type for layer, _ in layers} == {AttentionType.ENCODER_ONLY}
    assert layers[0][0].scale == config.head_size**-0.5
    model.init_random_weights(0)
    first = model.state_dict()["encoder.layer.0.attention.self.query.weight"].clone()
    model.init_random_weights(0)
    assert torch.equal(first, model.state_dict()["encoder.layer.0.attention.self.query.weight"])
    assert torch.equal(model.embeddings.LayerNorm.weight, torch.ones(16))
    assert not any(p.requires_grad for p in model.parameters())


def corrupt(path, edit):
    file = path / "model.safetensors"
    state = load_file(file)
    edit(state)
    save_file(state, file)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda s: s.pop("encoder.layer.1.output.dense.bias"), r"encoder\.layer\.1\.output\.dense"),
        (
            lambda s: s.update({"embeddings.word_embeddings.weight": torch.zeros(3, 64)}),
            r"embeddings\.word_embeddings\.weight has shape \(3, 64\).*implies \(128, 64\)",
        ),
        (lambda s: s.update({"encoder.layer.2.extra": torch.zeros(1)}), r"encoder\.layer\.2"),
    ],
    ids=["missing", "wrong-shape", "unexpected"],
)
def test_bad_checkpoint_names_the_weight(tmp_path, edit, match):
    path = save_hf_model(make_hf_bert(), tmp_path)
    corrupt(path, edit)
    with pytest.raises(ValueError, match=match):
        load_bert(path, ReferenceAttentionBackend)


BASE = dict(
    vocab_size=32,
    hidden_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    intermediate_size=24,
)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"hidden_act": "gelu_fast"}, r"hidden_act='gelu_fast'.*gelu, gelu_new"),
        ({"is_decoder": True}, r"is_decoder=True"),
        ({"add_cross_attention": True}, r"add_cross_attention"),
        ({"position_embedding_type": "relative_key"}, r"position_embedding_type='relative_key'"),
        ({"model_type": "roberta"}, r"model_type='roberta'"),
        ({"num_attention_heads": 3}, r"hidden_size=16 is not a multiple of num_heads=3"),
        ({"intermediate_size": None}, r"intermediate_size"),
    ],
)
def test_config_errors_name_the_field(overrides, match):
    hf = {**BASE, **overrides}
    if overrides.get("intermediate_size", 0) is None:
        del hf["intermediate_size"]
    with pytest.raises(ValueError, match=match):
        bert_config_from_hf(hf, "tiny")
