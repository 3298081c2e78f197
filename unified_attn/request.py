"""The request as the KV-cache managers and the scheduler see it.

A leaf module (it imports nothing from the package) so that `managers` and `runner` can both use
it without importing upward.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

BlockHasher = Callable[["Request"], list[bytes]]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED")


class Request:
    """Token ids, chained block hashes and progress of one request.

    `block_hashes` grows as tokens arrive: the `block_hasher` hashes every newly full block of
    prompt and generated tokens (never a partial tail block).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        block_hasher: BlockHasher | None = None,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        sampling_params: Any = None,
        arrival_index: int = 0,
        encoder_token_ids: Sequence[int] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        # Encoder-decoder models: the encoder's input (its keys and values live in the
        # cross-attention groups; the decoder block hashes fingerprint it).
        self.encoder_token_ids = list(encoder_token_ids or ())
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(self.prompt_token_ids)
        self.cache_salt = cache_salt
        self.lora_name = lora_name
        self.sampling_params = sampling_params
        self.arrival_index = arrival_index
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Tokens scheduled by a step whose outputs have not been processed yet (async steps).
        self.num_in_flight_tokens = 0
        # Overlapped steps (`engine/step_loop.py`): tokens sampled by launched steps whose ids
        # have not reached the host yet; the scheduler counts them as known tokens and the
        # runner feeds them to the next step from the device.
        self.num_output_placeholders = 0
        self.num_preemptions = 0
        # What ended it besides a length cap or EOS: a stop token id (set by the scheduler) or a
        # stop string (set by the engine, which reads the text).
        self.stop_reason: int | str | None = None
        # Speculative decoding: draft tokens proposed for the next step (decode only).
        self.spec_token_ids: list[int] = []
        # State layers with speculative decoding: the column of the request's state table that
        # holds its state, the last token its previous step kept (`backends/state_rows.py`)
        self.state_column = 0
        # Requests that need logits of every prompt position recompute the whole prompt.
        self.skip_reading_prefix_cache = False
        # Prompt tokens its first admission found in the prefix cache (-1: not admitted yet).
        self.num_cached_tokens = -1
        # `SamplingParams.bad_words` as token id sequences (the engine tokenizes them).
        self.bad_words_token_ids: list[list[int]] = []
        self.block_hashes: list[bytes] = []
        self._block_hasher = block_hasher
        self._update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_encoder_tokens(self) -> int:
        return len(self.encoder_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        if isinstance(token_ids, int):
            self.output_token_ids.append(token_ids)
            self.all_token_ids.append(token_ids)
        else:
            self.output_token_ids.extend(token_ids)
            self.all_token_ids.extend(token_ids)
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    def _update_block_hashes(self) -> None:
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, status={self.status.value})"
        )
