"""The model-family seam: a Llama-like family with one config quirk, defined here (not in the
package), is one class and one `register_family` call; the engine, `plan` and `models` serve it
with no other change. And the package's own families answer for their presets, shapes and
checkpoints."""

from __future__ import annotations

import json

import attrs
import pytest

from tests.models.hf_models import make_hf_model, save_hf_model
from unified_attn import LLMEngine, SamplingParams
from unified_attn.cli import main
from unified_attn.models import PRESETS, LayerKind, ModelConfig, get_preset
from unified_attn.models.families import base, families, family_for_hf, family_of, register_family
from unified_attn.models.families.decoder_family import DecoderFamily
from unified_attn.models.hf import read_hf_config


@attrs.frozen(kw_only=True)
class AlternatingConfig(ModelConfig):
    local_window: int = 16  # the quirk: even layers slide over this many tokens


def as_decoder(config: AlternatingConfig) -> ModelConfig:
    fields = {f.name: getattr(config, f.name) for f in attrs.fields(ModelConfig)}
    local, full = LayerKind.sliding(config.local_window), LayerKind.full()
    kinds = [local if i % 2 == 0 else full for i in range(config.num_layers)]
    return ModelConfig(**{**fields, "layer_kinds": kinds})


TINY = {f.name: getattr(get_preset("tiny-llama"), f.name) for f in attrs.fields(ModelConfig)}
TINY.pop("layer_kinds")


class AlternatingFamily(DecoderFamily):
    name = "alternating"
    config_type = AlternatingConfig
    presets = {"alternating-tiny": AlternatingConfig(**{**TINY, "name": "alternating-tiny"},
                                                     local_window=8)}  # fmt: skip
    shapes = {}
    hf_priority = 0

    def reads_hf(self, hf):
        return hf.get("model_type") == "alternating_llama"

    def attention_kinds(self, config):
        return super().attention_kinds(as_decoder(config))

    def build(self, config, backend_cls, **kwargs):
        return super().build(as_decoder(config), backend_cls, **kwargs)

    def describe(self, config):
        return super().describe(as_decoder(config))

    def full_attention_layers(self, config, *args):
        return super().full_attention_layers(as_decoder(config), *args)

    def theoretical_ratio(self, config, *args):
        return super().theoretical_ratio(as_decoder(config), *args)


@pytest.fixture
def alternating(monkeypatch):
    monkeypatch.setattr(base, "_FAMILIES", list(base._FAMILIES))  # forgotten afterwards
    return register_family(AlternatingFamily())


def test_a_family_defined_outside_the_package_runs_through_the_engine(alternating):
    config = alternating.presets["alternating-tiny"]
    assert family_of(config) is alternating
    engine = LLMEngine("alternating-tiny", max_model_len=256)
    groups = [(g["manager"], len(g["layers"])) for g in engine.kv_cache_report.groups]
    assert groups == [("SlidingWindowManager", 2), ("FullAttentionManager", 2)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    (out,) = engine.generate([list(range(3, 40))], params)
    assert len(out.output_token_ids) == 6
    assert engine.model.config.layer_kinds == as_decoder(config).layer_kinds


def test_plan_and_models_describe_the_new_family(alternating, capsys):
    assert main(["plan", "--model", "alternating-tiny", "--kv-cache-memory", "1MiB", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    managers = [g["manager"] for g in report["hybrid"]["groups"]]
    assert managers == ["SlidingWindowManager", "FullAttentionManager"]
    assert report["capacity_ratio"] > 1
    assert main(["models", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)["presets"]}
    assert rows["alternating-tiny"]["layer_kinds"] == "sliding 8 x2, full x2"


def test_a_checkpoint_of_the_new_family_is_read_by_it(alternating, tmp_path):
    hf = make_hf_model("llama", num_hidden_layers=2)
    path = save_hf_model(hf, tmp_path)
    config = json.loads((path / "config.json").read_text())
    assert family_for_hf(config).name == "decoder"
    config["model_type"] = "alternating_llama"
    (path / "config.json").write_text(json.dumps(config))
    assert family_for_hf(read_hf_config(path)) is alternating


def test_every_preset_and_shape_belongs_to_one_family():
    names = [n for family in families() for n in [*family.presets, *family.shapes]]
    assert len(names) == len(set(names))
    assert set(PRESETS) <= set(names)
    for family in families():
        for config in [*family.presets.values(), *family.shapes.values()]:
            assert family_of(config) is family
            assert family.describe(config)["name"] == config.name


def test_every_listed_architecture_is_read_by_a_family():
    """`unified-attn models` lists what loads: each architecture goes to the family that reads
    it, the state-space hybrids to theirs (by architecture or, without one, model type)."""
    from unified_attn.models import supported_architectures
    from unified_attn.models.families import HYBRIDS, family_for_hf

    for arch in supported_architectures():
        family = family_for_hf({"architectures": [arch]})
        hybrid = arch in {"Mamba2ForCausalLM", "BambaForCausalLM", "NemotronHForCausalLM",
                          "GraniteMoeHybridForCausalLM"}  # fmt: skip
        assert (family is HYBRIDS) == hybrid, arch
    assert family_for_hf({"model_type": "nemotron_h"}) is HYBRIDS
    assert family_for_hf({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}) \
        is not HYBRIDS
