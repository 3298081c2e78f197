"""BART (`EncoderDecoderModel`, `load_bart`) against transformers'
`BartForConditionalGeneration`: encoder output, decoder logits over the paged self- and cross-
attention caches, checkpoint layouts, and the errors of bad configs and checkpoints."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.models.hf_encoder_models import (
    BART_SMALL,
    make_hf_bart,
    packed,
    prompts,
    save_hf_model,
)
from unified_attn.backend import AttentionType, CommonAttentionMetadata
from unified_attn.backends.reference import ReferenceAttentionBackend
from unified_attn.models.bart import BartConfig, EncoderDecoderModel
from unified_attn.models.hf_encoders import bart_config_from_hf, load_bart
from unified_attn.runner.step_inputs import encoder_metadata
from unified_attn.runner.worker import Worker

ENCODER_LENS = [11, 5]
DECODER_LENS = [6, 3]
BLOCK_SIZE = 4
MAX_LEN = 32


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "scaled-embedding"])
def checkpoint(request, tmp_path_factory):
    hf = make_hf_bart(scale_embedding=request.param, activation_function="gelu")
    path = save_hf_model(hf, tmp_path_factory.mktemp("bart"))
    model, tokenizer = load_bart(path, ReferenceAttentionBackend)
    assert tokenizer is None
    return hf, model


def encode(model: EncoderDecoderModel, batch: list[list[int]]) -> torch.Tensor:
    """The encoder output `[E, d_model]` of `batch`, packed."""
    common = encoder_metadata([len(p) for p in batch], torch.device("cpu"))
    model.backends["encoder"].prep_forward(common, {})
    return model.encode(*packed(batch))


def test_encoder_matches_transformers(checkpoint):
    hf, model = checkpoint
    batch = prompts(ENCODER_LENS)
    ours = encode(model, batch).split(ENCODER_LENS)
    for prompt, hidden in zip(batch, ours, strict=True):
        with torch.no_grad():
            expected = hf.model.encoder(torch.tensor([prompt])).last_hidden_state[0]
        assert (hidden - expected).abs().max() < 1e-4


class PagedSteps:
    """Steps of the decoder over caches the worker allocated; request i owns its own blocks in
    every group (the groups alias the same bytes, so ids are distinct across groups too)."""

    def __init__(self, model: EncoderDecoderModel, num_reqs: int) -> None:
        worker = Worker(
            model,
            device="cpu",
            max_model_len=MAX_LEN,
            max_in_flight_tokens=MAX_LEN,
            block_size=BLOCK_SIZE,
            kv_cache_memory=1 << 22,
        )
        per_req = MAX_LEN // BLOCK_SIZE
        groups = worker.plan.groups
        worker.allocate(worker.determine_num_blocks())
        assert worker.num_blocks > len(groups) * num_reqs * per_req
        self.model = model
        self.cross = {
            gid for gid, g in enumerate(groups) if g.manager_cls.__name__ == "CrossAttentionManager"
        }
        assert len(self.cross) == 1
        first = 1 + torch.arange(len(groups))[:, None, None] * num_reqs * per_req
        ids = first + torch.arange(num_reqs * per_req).view(num_reqs, per_req)
        self.tables = {gid: ids[gid].int() for gid in range(len(groups))}
        self.computed = [0] * num_reqs
        self.encoder_lens = [0] * num_reqs

    def step(self, tokens: dict[int, list[int]], encoder_inputs: dict[int, list[int]]):
        """Feed requests' next decoder tokens; `encoder_inputs`: the requests admitted now.
        Logits `[T, vocab]` of the fed tokens, in request order."""
        reqs = sorted(tokens)
        for i, prompt in encoder_inputs.items():
            self.encoder_lens[i] = len(prompt)
        encoded = sorted(encoder_inputs)
        encoder_hidden = (
            encode(self.model, [encoder_inputs[i] for i in encoded]) if encoded else None
        )
        common = self.metadata(reqs, [len(tokens[i]) for i in reqs], encoded)
        tables = {gid: table[reqs] for gid, table in self.tables.items()}
        for name in ("decoder", "cross"):
            self.model.backends[name].prep_forward(common, tables)
        ids = torch.tensor([t for i in reqs for t in tokens[i]])
        hidden = self.model(ids, common.positions, encoder_hidden)
        for i in reqs:
            self.computed[i] += len(tokens[i])
        return self.model.compute_logits(hidden)

    def metadata(
        self, reqs: list[int], query_lens: list[int], encoded: list[int]
    ) -> CommonAttentionMetadata:
        computed = torch.tensor([self.computed[i] for i in reqs], dtype=torch.int32)
        seq_lens = computed + torch.tensor(query_lens, dtype=torch.int32)
        qsl = torch.zeros(len(reqs) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)
        rows = [
            (i, p) for i, c, s in zip(reqs, computed, seq_lens, strict=True) for p in range(c, s)
        ]
        enc_rows = [(i, p) for i in encoded for p in range(self.encoder_lens[i])]
        slots = {
            gid: self.slots(table, enc_rows if gid in self.cross else rows)
            for gid, table in self.tables.items()
        }
        encoder_lens = torch.tensor([self.encoder_lens[i] for i in reqs], dtype=torch.int32)
        return CommonAttentionMetadata(
            query_start_loc=qsl,
            query_start_loc_cpu=qsl,
            seq_lens=seq_lens,
            seq_lens_cpu=seq_lens,
            num_computed_tokens_cpu=computed,
            positions=torch.tensor([p for _, p in rows]),
            num_reqs=len(reqs),
            num_actual_tokens=len(rows),
            max_query_len=max(query_lens),
            max_seq_len=int(seq_lens.max()),
            slot_mappings=slots,
            block_sizes=dict.fromkeys(self.tables, BLOCK_SIZE),
            encoder_seq_lens_cpu=encoder_lens,
            encoder_seq_lens=encoder_lens,
        )

    @staticmethod
    def slots(table: torch.Tensor, rows: list[tuple[int, int]]) -> torch.Tensor:
        """The slot of each (request, position) row in the request's blocks of `table`."""
        return torch.tensor(
            [int(table[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for i, p in rows],
            dtype=torch.int64,
        )


@torch.no_grad()
def hf_logits(hf, encoder_input: list[int], decoder_input: list[int]) -> torch.Tensor:
    out = hf(
        input_ids=torch.tensor([encoder_input]), decoder_input_ids=torch.tensor([decoder_input])
    )
    return out.logits[0].float()


def test_decoder_logits_match_transformers(checkpoint):
    """Request 0 is admitted (encoder + decoder prefill); then it decodes one token while
    request 1 is admitted; then both decode. Every step's logits match transformers'."""
    hf, model = checkpoint
    encoder_inputs = prompts(ENCODER_LENS, seed=1)
    decoder_inputs = prompts([n + 2 for n in DECODER_LENS], seed=2)
    runner = PagedSteps(model, num_reqs=2)
    n0, n1 = DECODER_LENS
    steps = [
        ({0: decoder_inputs[0][:n0]}, {0: encoder_inputs[0]}),
        ({0: decoder_inputs[0][n0 : n0 + 1], 1: decoder_inputs[1][:n1]}, {1: encoder_inputs[1]}),
        ({0: decoder_inputs[0][n0 + 1 :], 1: decoder_inputs[1][n1 : n1 + 1]}, {}),
    ]
    for tokens, admitted in steps:
        logits = runner.step(tokens, admitted).split([len(tokens[i]) for i in sorted(tokens)])
        for i, ours in zip(sorted(tokens), logits, strict=True):
            end = runner.computed[i]
            expected = hf_logits(hf, encoder_inputs[i], decoder_inputs[i][:end])
            assert (ours - expected[end - len(tokens[i]) : end]).abs().max() < 1e-4


def tiny_config(**overrides) -> BartConfig:
    fields = dict(
        vocab_size=32,
        d_model=16,
        encoder_layers=2,
        decoder_layers=3,
        encoder_attention_heads=4,
        decoder_attention_heads=2,
        encoder_ffn_dim=24,
        decoder_ffn_dim=20,
        max_position_embeddings=40,
    )
    return BartConfig(**{**fields, **overrides})


def test_model_interface():
    config = tiny_config()
    model = EncoderDecoderModel(config, ReferenceAttentionBackend)
    assert config.hidden_size == 16 and config.head_size == 8 and config.num_kv_heads == 2
    assert config.eos_token_ids == (2,)
    types = {
        "encoder": AttentionType.ENCODER,
        "decoder": AttentionType.DECODER,
        "cross": AttentionType.ENCODER_DECODER,
    }
    assert {name: b.attn_type for name, b in model.backends.items()} == types
    assert model.backends["cross"].max_encoder_len == 40
    layers = list(model.attention_layers())
    names = [f"model.encoder.layers.{i}.self_attn" for i in range(2)]
    for i in range(3):
        names += [f"model.decoder.layers.{i}.self_attn", f"model.decoder.layers.{i}.encoder_attn"]
    assert [layer.name for layer, _ in layers] == names
    for layer, backend in layers:
        assert backend.attn_type == layer.attn_type
        assert layer.scale == layer.head_size**-0.5
    assert layers[0][0].head_size == 4 and layers[-1][0].head_size == 8
    state = model.state_dict()
    assert state["model.encoder.embed_positions.weight"].shape == (42, 16)
    assert state["final_logits_bias"].shape == (1, 32)
    assert "lm_head.weight" not in state and "model.encoder.embed_tokens.weight" not in state
    model.init_random_weights(3)
    assert torch.equal(model.model.decoder.layernorm_embedding.weight, torch.ones(16))
    logits = model.compute_logits(torch.zeros(2, 16))
    assert logits.dtype == torch.float32 and logits.shape == (2, 32)


def rewrite(path, edit):
    file = path / "model.safetensors"
    state = load_file(file)
    edit(state)
    save_file(state, file)


@pytest.mark.parametrize("keep_shared", [True, False])
def test_checkpoint_with_copies_of_the_shared_embedding_loads(tmp_path, checkpoint, keep_shared):
    hf, _ = checkpoint
    shared = hf.model.shared.weight.detach()

    def add_copies(state):
        for name in ("lm_head", "model.encoder.embed_tokens", "model.decoder.embed_tokens"):
            state[f"{name}.weight"] = shared.clone()
        if not keep_shared:
            del state["model.shared.weight"]

    path = save_hf_model(hf, tmp_path)
    rewrite(path, add_copies)
    loaded, _ = load_bart(path, ReferenceAttentionBackend)
    assert torch.equal(loaded.model.shared.weight, shared)


def test_bart_model_checkpoint_loads_with_a_zero_logits_bias(tmp_path, checkpoint):
    hf, _ = checkpoint
    loaded, _ = load_bart(save_hf_model(hf.model, tmp_path), ReferenceAttentionBackend)
    assert torch.equal(loaded.model.shared.weight, hf.model.shared.weight)
    name = "decoder.layers.1.fc1.bias"
    assert torch.equal(loaded.state_dict()[f"model.{name}"], hf.model.state_dict()[name])
    assert not loaded.final_logits_bias.any()


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda s: s.pop("model.decoder.layers.1.fc2.bias"), r"model\.decoder\.layers\.1\.fc2"),
        (
            lambda s: s.update({"model.encoder.embed_positions.weight": torch.zeros(64, 64)}),
            r"model\.encoder\.embed_positions\.weight has shape \(64, 64\).*implies \(66, 64\)",
        ),
        (lambda s: s.update({"model.decoder.layers.5.x": torch.zeros(1)}), r"layers\.5\.x"),
    ],
    ids=["missing", "wrong-shape", "unexpected"],
)
def test_bad_checkpoint_names_the_weight(tmp_path, edit, match):
    path = save_hf_model(make_hf_bart(), tmp_path)
    rewrite(path, edit)
    with pytest.raises(ValueError, match=match):
        load_bart(path, ReferenceAttentionBackend)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"activation_function": "tanh"}, r"activation_function='tanh'.*gelu, gelu_new"),
        ({"add_final_layer_norm": True}, r"add_final_layer_norm=True"),
        ({"normalize_before": True}, r"normalize_before=True"),
        ({"static_position_embeddings": True}, r"static_position_embeddings"),
        ({"tie_word_embeddings": False}, r"tie_word_embeddings=False"),
        ({"model_type": "mbart"}, r"model_type='mbart'"),
        ({"decoder_attention_heads": 5}, r"d_model=64 is not a multiple of decoder_attention"),
        ({"encoder_ffn_dim": None}, r"encoder_ffn_dim"),
    ],
)
def test_config_errors_name_the_field(overrides, match):
    hf = {**BART_SMALL, **overrides}
    if "encoder_ffn_dim" in overrides:
        del hf["encoder_ffn_dim"]
    with pytest.raises(ValueError, match=match):
        bart_config_from_hf(hf, "tiny")


def test_config_reads_special_tokens():
    config = bart_config_from_hf(
        {**BART_SMALL, "eos_token_id": [2, 5], "forced_bos_token_id": 0}, "tiny"
    )
    assert config.eos_token_id == 2 and config.eos_token_ids == (2, 5)
    assert config.forced_bos_token_id == 0 and config.decoder_start_token_id == 2
