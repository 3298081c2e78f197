"""`LLM.chat` renders conversations with the checkpoint tokenizer's chat template (as
transformers' `apply_chat_template` does) and generates; `use_tqdm=True` draws a progress bar on
stderr and changes nothing else."""

import json

import pytest
from safetensors.torch import save_file

from tests.models.test_tokenizer import save_word_tokenizer
from unified_attn import LLM, SamplingParams
from unified_attn.backends.reference import ReferenceAttentionBackend
from unified_attn.models import DecoderModel
from unified_attn.models.hf_config import config_from_hf

transformers = pytest.importorskip("transformers")

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
    "num_key_value_heads": 1, "max_position_embeddings": 256, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 1,
}  # fmt: skip
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}world{% endif %}"
)
CHAT = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat")
    (path / "config.json").write_text(json.dumps(LLAMA))
    model = DecoderModel(config_from_hf(LLAMA), ReferenceAttentionBackend)
    model.init_random_weights(0)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              path / "model.safetensors")  # fmt: skip
    save_word_tokenizer(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(str(path))
    return path


def test_chat_prompts_are_the_templates_tokens(checkpoint):
    llm = LLM(str(checkpoint))
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    (out,) = llm.chat(CHAT, params, use_tqdm=False)
    hf = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    rendered = hf.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    want = rendered["input_ids"]
    assert out.prompt_token_ids == list(want) == [0, 3, 4, 4]  # <s> hello world + world
    (again,) = llm.generate([list(want)], params, use_tqdm=False)
    assert again.output_token_ids == out.output_token_ids
    two = llm.chat([CHAT, CHAT[:1]], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in two] == [[0, 3, 4, 4], [0, 3, 4]]


@pytest.mark.parametrize("messages", ["hello", [], [{"content": "hi"}], [["not a message"]]])
def test_messages_that_are_not_a_conversation_are_refused(checkpoint, messages):
    with pytest.raises(ValueError, match="must be a non-empty list of messages"):
        LLM(str(checkpoint)).chat(messages)


def test_a_model_without_a_chat_template_is_told_so():
    with pytest.raises(ValueError, match="has no tokenizer with a chat template"):
        LLM("tiny-llama").chat(CHAT)


def test_use_tqdm_draws_on_stderr_and_changes_nothing(capsys):
    llm = LLM("tiny-llama")
    params = SamplingParams(max_tokens=3)
    plain = llm.generate([[1, 2], [3, 4, 5]], params, use_tqdm=False)
    capsys.readouterr()
    shown = llm.generate([[1, 2], [3, 4, 5]], params, use_tqdm=True)
    captured = capsys.readouterr()
    assert captured.out == "" and [o.output_token_ids for o in shown] == [
        o.output_token_ids for o in plain
    ]
    with pytest.raises(ValueError, match="use_tqdm must be True or False"):
        llm.generate([[1]], params, use_tqdm="yes")
