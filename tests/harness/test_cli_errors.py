"""What a new user meets: every bad input to `unified-attn` is one line on stderr naming the
problem, exit code 2 and no traceback; Ctrl-C is one "interrupted" line and exit code 130."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from unified_attn.backends.reference import ReferenceAttentionBackend
from unified_attn.cli import main
from unified_attn.models import DecoderModel
from unified_attn.models.hf_config import config_from_hf

FAST = ["--num-requests", "2", "--max-tokens", "2"]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")

# A Llama checkpoint without tokenizer files (256 positions).
TINY_LLAMA_HF = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("no-tokenizer")
    (path / "config.json").write_text(json.dumps(TINY_LLAMA_HF))
    model = DecoderModel(config_from_hf(TINY_LLAMA_HF), ReferenceAttentionBackend)
    model.init_random_weights(0)
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, path / "model.safetensors"
    )
    return str(path)


CASES = [
    # devices this machine lacks, or that are no device at all
    pytest.param(["run", "--device", "cuda", *FAST], "'cuda' needs a CUDA GPU", marks=NO_CUDA),
    pytest.param(["run", "--device", "cuda:0", *FAST], "'cuda:0' needs a CUDA GPU", marks=NO_CUDA),
    (["run", "--device", "gpu", *FAST], "device 'gpu' is not a device name"),
    pytest.param(["check", "reference", "--device", "cuda"], "needs a CUDA GPU", marks=NO_CUDA),
    (["check", "reference", "--device", "gpu"], "device 'gpu' is not a device name"),
    (["backends", "--device", "gpu"], "device 'gpu' is not a device name"),
    # memory
    (["run", "--kv-cache-memory", "1024TiB", *FAST], "is more than this machine's RAM has"),
    (["run", "--kv-cache-memory", "0", *FAST], "memory size '0' is zero"),
    (["plan", "--kv-cache-memory", "0"], "memory size '0' is zero"),
    (["plan", "--kv-cache-memory=-1GiB"], "memory size '-1GiB' is negative"),
    (["plan", "--kv-cache-memory", "5XB"], "unknown unit 'XB'; use B, KiB, MiB, GiB, TiB"),
    (["plan", "--kv-cache-memory", "1KiB"], "1.0 KiB holds no KV-cache block"),
    # counts that must be positive
    (["check", "reference", "--threads", "0"], "--threads: expected a positive integer, got 0"),
    (["check", "reference", "--threads", "-2"], "--threads: expected a positive integer, got -2"),
    (["migrate", "--legacy", "reference", "--native", "reference", "--threads", "0"],
     "--threads: expected a positive integer, got 0"),
    (["run", "--max-model-len", "0", *FAST], "--max-model-len: expected a positive integer"),
    (["run", "--max-model-len", "-8", *FAST], "--max-model-len: expected a positive integer"),
    (["plan", "--max-model-len", "0"], "--max-model-len: expected a positive integer"),
    (["run", "--num-requests", "0"], "--num-requests: expected a positive integer, got 0"),
    (["run", "--num-requests", "-1"], "--num-requests: expected a positive integer, got -1"),
    (["run", "--max-tokens", "0"], "--max-tokens: expected a positive integer, got 0"),
    (["run", "--max-num-seqs", "x"], "--max-num-seqs: expected a positive integer, got 'x'"),
    # what fits max_model_len: refused with what would fit, never cut
    (["run", "--max-model-len", "64", "--max-tokens", "100"],
     "requests need up to 244 tokens (a 96-token prefix, a tail of up to 48 tokens and "
     "--max-tokens 100) but max_model_len is 64; raise --max-model-len to at least 244"),
    (["run", "--max-model-len", "160", "--max-tokens", "32", "--num-requests", "2"],
     "lower --max-tokens to at most 16 or raise --max-model-len to at least 176"),
    (["run", "--prompt", "x" * 3000, *FAST], "shorten --prompt to at most"),
    (["plan", "--model", "tiny-llama", "--max-model-len", "4096"],
     "max_model_len=4096 exceeds the model's max_position_embeddings=2048; give at most 2048"),
    # names: backends, models, dtypes, prompts
    (["run", "--backend", "nosuch", *FAST], "unknown attention backend 'nosuch'; use one of "),
    (["run", "--backend", "nosuch", *FAST],
     "legacy-reference, legacy-triton (see `unified-attn backends`) or module:Class"),
    (["run", "--backend", "no_such_module:Thing", *FAST], "cannot import 'no_such_module'"),
    (["run", "--backend", "linear-state", *FAST],
     "attention backend 'linear-state' cannot serve this model: serves linear_state layers"),
    (["check", "nosuch"], "unknown attention backend 'nosuch'"),
    (["run", "--dtype", "fp8", *FAST], "--dtype: invalid choice: 'fp8'"),
    (["run", "--model", "no-such-model", *FAST], "is neither a preset"),
    (["plan", "--model", "no-such-model"], "real-model shape"),
    (["run", "--prompt", "hi", "--prompt-ids", "1", *FAST], "not allowed with argument"),
    (["run", "--prompt-ids", "1,x", *FAST], "expected comma-separated token ids"),
    (["run", "--temperature", "-1", *FAST], "--temperature: expected a finite number >= 0"),
    (["run", "--temperature", "inf", *FAST], "expected a finite number >= 0, got inf"),
    (["run", "--seed", "-1", *FAST], "--seed: expected an int in [0, 9223372036854775807]"),
    (["run", "--seed", "1" * 70, *FAST], "--seed: expected an int in"),
    (["check", "reference", "--seed", "-3"], "--seed: expected an int in"),
    (["run", "--prompt=", *FAST], "--prompt: expected a non-empty value"),
    (["run", "--model", "", *FAST], "model is empty"),
    (["run", "--kv-cache-memory", "-5GiB", *FAST], "memory size '-5GiB' is negative"),
    (["run", "--model", "gpt-oss-20b", *FAST], "is a real model's shape for `unified-attn plan`"),
    (["run", "--num-requests", "100000000000", "--max-tokens", "2"],
     "--num-requests 100000000000 would queue about"),
    (["run", "--speculative-method", "draft", *FAST], "--speculative-method 'draft' needs "
     "--draft-model"),
    (["run", "--backend", "linear-state", *FAST], "Backends that can: ['reference', 'triton']"),
    (["migrate", "--legacy", "reference", "--native", "reference", "--atol", "-1"],
     "--atol: expected a finite number >= 0, got -1.0"),
    (["migrate", "--legacy", "reference", "--native", "reference", "--atol", "nan"],
     "--atol: expected a finite number >= 0, got nan"),
    (["migrate", "--legacy", "nosuch", "--native", "reference", "--small"],
     "--legacy 'nosuch' is not a legacy backend; use one of legacy-reference, legacy-triton"),
    (["migrate", "--legacy", "mla-reference", "--native", "reference", "--small"],
     "--legacy 'mla-reference' is a native backend"),
    (["migrate", "--legacy", "reference", "--native", "legacy-reference", "--small"],
     "--native 'legacy-reference' is the adapter over a legacy backend"),
    (["models", "--bogus"], "unrecognized arguments: --bogus"),
    (["run", "--model", "{checkpoint}", "--prompt", "hi", *FAST],
     "has no tokenizer to encode text; pass token ids with --prompt-ids 1,2,3 or add the "
     "tokenizer files"),
    (["run", "--model", "{checkpoint}", "--prompt-ids", ",".join(["5"] * 300), *FAST],
     "shorten --prompt-ids to at most 206 tokens"),
]  # fmt: skip


@pytest.mark.parametrize("argv, message", CASES)
def test_bad_input_is_one_line_and_exit_code_2(capsys, checkpoint, argv, message):
    argv = [arg.replace("{checkpoint}", checkpoint) for arg in argv]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert message in err
    assert err.startswith("unified-attn") and ": error: " in err


def test_png_without_matplotlib_says_how_to_get_it(capsys, monkeypatch):
    from unified_attn.cli import plan

    monkeypatch.setattr(plan, "matplotlib_installed", lambda: False)
    assert main(["plan", "--png", "capacity.png"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--png needs matplotlib" in err and "pip install 'unified_attn[plot]'" in err


@pytest.mark.parametrize(
    "argv, target",
    [
        (["run", *FAST], "unified_attn.cli.run.run"),
        (["check", "reference"], "unified_attn.cli.check.run_conformance"),
        (["migrate", "--legacy", "reference", "--native", "reference"],
         "unified_attn.cli.migrate.run_migration"),
    ],
)  # fmt: skip
def test_ctrl_c_is_one_interrupted_line_and_exit_code_130(capsys, monkeypatch, argv, target):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(target, interrupt)
    assert main(argv) == 130
    assert capsys.readouterr().err == f"unified-attn {argv[0]}: interrupted\n"


def test_the_console_command_prints_no_traceback():
    """The same through a real process (`python -m unified_attn.cli`)."""
    result = subprocess.run(
        [sys.executable, "-m", "unified_attn.cli", "run", "--device", "gpu"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "unified-attn run: error: device 'gpu' is not a device name; use one of 'cpu', 'cuda' "
        "or 'cuda:N'"
    ]
