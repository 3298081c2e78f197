"""Checkpoint errors: every problem with a checkpoint directory is one `ValueError` naming the
checkpoint, what was expected, what was found and what to do."""

import builtins
import json
import shutil

import pytest

from tests.models.hf_models import make_family_model, make_hf_model, save_hf_model
from tests.models.test_hf import edit_config
from unified_attn.backends.reference import ReferenceAttentionBackend
from unified_attn.models import load_hf_model, supported_architectures
from unified_attn.models.hf_config import config_from_hf

SUPPORTED = [
    "BambaForCausalLM",
    "BartForConditionalGeneration",
    "BartModel",
    "BertForMaskedLM",
    "BertModel",
    "DeepseekV2ForCausalLM",
    "DeepseekV32ForCausalLM",
    "DeepseekV3ForCausalLM",
    "DeepseekV4ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "GptOssForCausalLM",
    "GraniteMoeHybridForCausalLM",
    "Llama4ForCausalLM",
    "LlamaForCausalLM",
    "Mamba2ForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "NemotronHForCausalLM",
    "Phi3ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen3NextForCausalLM",
]


def load(path):
    return load_hf_model(path, ReferenceAttentionBackend)


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    return save_hf_model(
        make_hf_model("llama", num_hidden_layers=1), tmp_path_factory.mktemp("llama")
    )


@pytest.fixture
def llama_path(saved_llama, tmp_path):
    """A fresh copy of a one-layer Llama checkpoint, free to break."""
    return shutil.copytree(saved_llama, tmp_path / "llama")


def test_supported_architectures_lists_every_family():
    assert supported_architectures() == SUPPORTED


# ---- the directory and config.json --------------------------------------------------------------


def test_not_a_directory(tmp_path):
    with pytest.raises(ValueError, match=r"checkpoint .*nowhere is not a directory"):
        load(tmp_path / "nowhere")


def test_no_config_json(tmp_path):
    with pytest.raises(ValueError, match=r"checkpoint directory .* has no config.json"):
        load(tmp_path)


def test_corrupt_config_json_names_the_file_and_the_position(llama_path):
    text = (llama_path / "config.json").read_text()
    (llama_path / "config.json").write_text(text[: text.index('"vocab_size"') + 14])  # cut off
    pattern = r"llama/config.json is not valid JSON: .*: line \d+ column \d+ \(char \d+\); fix"
    with pytest.raises(ValueError, match=pattern):
        load(llama_path)


def test_config_json_that_is_not_an_object(llama_path):
    (llama_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config.json holds a JSON list, expected an object"):
        load(llama_path)


def test_config_without_a_required_field_names_it(llama_path):
    config = json.loads((llama_path / "config.json").read_text())
    del config["hidden_size"]
    (llama_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json of llama has no 'hidden_size'"):
        load(llama_path)


def test_unsupported_architecture_names_it_and_the_supported(llama_path):
    edit_config(llama_path, architectures=["GPT2LMHeadModel"])
    pattern = r"architecture 'GPT2LMHeadModel' is not supported; supported architectures: "
    with pytest.raises(ValueError, match=pattern + ", ".join(SUPPORTED)):
        load(llama_path)


def test_missing_architectures_falls_back_to_model_type(llama_path):
    edit_config(llama_path, architectures=None)
    assert load(llama_path)[0].config.num_layers == 1
    edit_config(llama_path, model_type="gpt2")
    with pytest.raises(ValueError, match=r"names no architecture .*Gemma2ForCausalLM"):
        load(llama_path)


def test_unsupported_rope_type(llama_path):
    edit_config(
        llama_path, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    )
    with pytest.raises(ValueError, match="RoPE type 'dynamic'"):
        load(llama_path)


def test_phi3_longrope_is_refused():
    hf = {
        **json.loads(json.dumps(make_family_model("phi3").config.to_dict())),
        "rope_scaling": {"type": "su", "short_factor": [1.0], "long_factor": [1.0]},
        "rope_parameters": None,
    }
    with pytest.raises(ValueError, match=r"RoPE type 'su' \(LongRoPE.*\) is not supported"):
        config_from_hf(hf)


# ---- the weights --------------------------------------------------------------------------------


def test_no_weights(llama_path):
    (llama_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"llama has no weights: expected model.safetensors"):
        load(llama_path)


def test_pytorch_bin_weights_are_named(llama_path):
    (llama_path / "model.safetensors").rename(llama_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"PyTorch .bin weights \(pytorch_model.bin\)"):
        load(llama_path)


def test_safetensors_without_their_index(llama_path):
    (llama_path / "model.safetensors").rename(llama_path / "model-00001-of-00002.safetensors")
    with pytest.raises(ValueError, match=r"has model-00001-of-00002.safetensors but neither"):
        load(llama_path)


def test_shard_missing_from_a_sharded_checkpoint(tmp_path):
    hf = make_hf_model("llama", num_hidden_layers=2)
    path = save_hf_model(hf, tmp_path, max_shard_size="50KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (path / shard).unlink()
    with pytest.raises(ValueError, match=rf"shards \['{shard}'\] named by .* are missing"):
        load(path)


def test_hf_extra_not_installed(llama_path, monkeypatch):
    real_import = builtins.__import__

    def no_hf_packages(name, *args, **kwargs):
        if name.split(".")[0] in ("safetensors", "transformers"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_hf_packages)
    with pytest.raises(ValueError, match=r"needs the safetensors package.*pip install 'unified_"):
        load(llama_path)


def test_hf_extra_not_installed_for_the_tokenizer(llama_path, monkeypatch):
    from tests.models.test_tokenizer import save_word_tokenizer

    save_word_tokenizer(llama_path)
    real_import = builtins.__import__

    def no_transformers(name, *args, **kwargs):
        if name.split(".")[0] == "transformers":
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_transformers)
    pattern = r"ships a tokenizer.*needs the transformers package.*pip install 'unified_attn\[hf\]'"
    with pytest.raises(ValueError, match=pattern):
        load(llama_path)


def test_missing_weight_is_named(llama_path):
    from safetensors.torch import load_file, save_file

    file = llama_path / "model.safetensors"
    state = load_file(file)
    del state["model.layers.0.mlp.up_proj.weight"]
    save_file(state, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing \['model.layers.0.mlp.up_proj.weight'\]"):
        load(llama_path)


def test_untied_config_without_lm_head_is_missing_weight(llama_path):
    edit_config(llama_path, num_hidden_layers=2)
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.*and \d+ more"):
        load(llama_path)


def test_shape_mismatch_is_named(llama_path):
    edit_config(llama_path, intermediate_size=100)
    with pytest.raises(ValueError, match=r"mlp.down_proj.weight .* has shape \(64, 96\), the"):
        load(llama_path)


# ---- a config relabelled to another architecture ------------------------------------------------


@pytest.mark.parametrize(
    ("family", "relabel", "fits"),
    [
        ("qwen3", "LlamaForCausalLM", "Qwen3ForCausalLM"),  # q/k norms Llama has no place for
        ("phi3", "Qwen2ForCausalLM", "Phi3ForCausalLM"),  # fused projections
        ("mixtral", "Qwen2MoeForCausalLM", "MixtralForCausalLM"),  # no shared expert
    ],
)
def test_relabelled_architecture_names_the_one_that_fits(family, relabel, fits, tmp_path):
    path = save_hf_model(make_family_model(family), tmp_path)
    edit_config(path, architectures=[relabel])
    pattern = rf"weights do not fit architecture '{relabel}' .* but fit {fits}.*\[\"{fits}\"\]"
    with pytest.raises(ValueError, match=pattern):
        load(path)


def test_llama_relabelled_as_gemma2_fits_llama_and_mistral(llama_path):
    edit_config(llama_path, architectures=["Gemma2ForCausalLM"])
    pattern = r"but fit LlamaForCausalLM or MistralForCausalLM"
    with pytest.raises(ValueError, match=pattern):
        load(llama_path)


def test_unsupported_architecture_behind_a_supported_label(tmp_path):
    # OLMo 2 (norms after the blocks, q/k norms over all heads) saved, then labelled Llama.
    path = save_hf_model(make_hf_model("olmo2", num_hidden_layers=1), tmp_path)
    edit_config(path, architectures=["LlamaForCausalLM"])
    pattern = (
        r"architecture 'LlamaForCausalLM' named in config.json has no place for its weights "
        r".*the checkpoint's architecture is not supported "
        r"\(supported: BambaForCausalLM, BartForConditionalGeneration"
    )
    with pytest.raises(ValueError, match=pattern):
        load(path)
