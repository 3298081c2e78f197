import subprocess
import sys

from unified_attn.managers.hashing import (
    hash_block_tokens,
    hashes_at_block_size,
    request_block_hasher,
)
from unified_attn.request import Request


def test_hashes_are_chained_over_the_whole_prefix():
    a = hash_block_tokens(None, [1, 2])
    b = hash_block_tokens(a, [3, 4])
    assert hash_block_tokens(hash_block_tokens(None, [9, 9]), [3, 4]) != b
    assert len(a) == 32


def test_only_full_blocks_are_hashed_and_hashes_grow_with_tokens():
    hasher = request_block_hasher(4)
    req = Request("r", list(range(10)), block_hasher=hasher)
    assert len(req.block_hashes) == 2
    req.append_output_token_ids([10])
    assert len(req.block_hashes) == 2
    req.append_output_token_ids(11)
    assert len(req.block_hashes) == 3
    same = Request("s", list(range(12)), block_hasher=hasher)
    assert same.block_hashes == req.block_hashes


def test_cache_salt_changes_every_block_through_the_chain():
    hasher = request_block_hasher(2)
    plain = Request("a", [1, 2, 3, 4], block_hasher=hasher)
    salted = Request("b", [1, 2, 3, 4], block_hasher=hasher, cache_salt="s1")
    assert plain.block_hashes[0] != salted.block_hashes[0]
    assert plain.block_hashes[1] != salted.block_hashes[1]


def test_adapter_identity_is_on_every_block_and_tags_prevent_collisions():
    hasher = request_block_hasher(2)
    lora = Request("a", [1, 2, 3, 4], block_hasher=hasher, lora_name="x")
    salt = Request("b", [1, 2, 3, 4], block_hasher=hasher, cache_salt="x")
    assert lora.block_hashes[0] != salt.block_hashes[0]
    parent = lora.block_hashes[0]
    assert lora.block_hashes[1] == hash_block_tokens(parent, [3, 4], (("adapter", "x"),))


def test_hashes_are_reproducible_across_processes():
    code = (
        "from unified_attn.managers.hashing import hash_block_tokens;"
        "print(hash_block_tokens(None, [1, 2, 3], (('cache_salt', 's'),)).hex())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == hash_block_tokens(None, [1, 2, 3], (("cache_salt", "s"),)).hex()


def test_coarse_block_hash_is_the_last_fine_hash_inside_it():
    fine = [b"A", b"B", b"C", b"D"]
    assert hashes_at_block_size(fine, 16, 32) == [b"B", b"D"]
    assert hashes_at_block_size(fine, 16, 16) is fine
