"""Ranks started by torchrun instead of spawned (CPU, gloo): one node with two processes, and
two "nodes" (two torchrun launchers on this host, one process each) give the tokens of one
device; a launcher world that is not `tensor_parallel_size` is refused."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from unified_attn import LLMEngine, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 4, list(range(40, 70))]
MAX_TOKENS = 12

SCRIPT = f"""
import json, os, sys
from unified_attn import LLMEngine, SamplingParams

if __name__ == "__main__":
    size = int(sys.argv[2])
    # under torchrun, ranks other than 0 serve inside the constructor and end there
    engine = LLMEngine("tiny-llama", tensor_parallel_size=size, kv_cache_memory="4MiB")
    try:
        params = SamplingParams(max_tokens={MAX_TOKENS}, ignore_eos=True)
        outs = engine.generate({PROMPTS!r}, params)
    finally:
        engine.shutdown()
    report = {{"rank": os.environ["RANK"], "spawned": len(engine._tp.processes),
              "blocks": engine.rank_num_blocks, "tokens": [o.output_token_ids for o in outs]}}
    json.dump(report, open(sys.argv[1], "w"))
"""


def one_device() -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.output_token_ids for o in LLMEngine("tiny-llama").generate(PROMPTS, params)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(tmp_path: Path, *launcher_args: str, size: int = 2) -> subprocess.Popen:
    script = tmp_path / "generate.py"
    script.write_text(SCRIPT)
    command = [sys.executable, "-m", "torch.distributed.run", *launcher_args, str(script),
               str(tmp_path / "out.json"), str(size)]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen) -> tuple[int, str]:
    out, _ = process.communicate(timeout=240)
    return process.returncode, out


def test_one_node_two_processes(tmp_path):
    code, log = finish(
        torchrun(tmp_path, "--nproc-per-node", "2", "--master-port", str(free_port()))
    )
    assert code == 0, log
    check_rank_0_report(tmp_path)


def check_rank_0_report(tmp_path: Path) -> None:
    """Only rank 0 returned from the constructor; it spawned no rank; both ranks sized a
    cache; the tokens are one device's."""
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["rank"] == "0" and report["spawned"] == 0
    assert len(report["blocks"]) == 2
    assert report["tokens"] == one_device()


def test_two_nodes(tmp_path):
    port = str(free_port())
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
              "--master-port", port]  # fmt: skip
    nodes = [torchrun(tmp_path, *common, "--node-rank", str(r)) for r in (0, 1)]
    results = [finish(node) for node in nodes]
    assert all(code == 0 for code, _ in results), results
    check_rank_0_report(tmp_path)


def test_a_launcher_world_other_than_the_ranks_is_refused(tmp_path):
    process = torchrun(tmp_path, "--nproc-per-node", "3", "--master-port", str(free_port()))
    code, log = finish(process)
    assert code != 0
    assert "tensor_parallel_size=2 but the launcher started WORLD_SIZE=3 processes" in log
