"""Request and RequestStatus as vLLM 0.32 has them (vllm/v1/request.py), reduced."""

from __future__ import annotations

import enum
from collections.abc import Sequence

from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_utils import BlockHash, hash_block_tokens


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    WAITING_FOR_STREAMING_REQ = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # anything after PREEMPTED is a finished status
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()
    FINISHED_REPETITION = enum.auto()

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        priority: int = 0,
        block_size: int = 32,
        eos_token_id: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.priority = priority
        self.sampling_params = sampling_params
        self.status = RequestStatus.WAITING
        self.max_tokens = sampling_params.max_tokens
        self.eos_token_id = eos_token_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self._block_size = block_size
        # one chained hash per full block of all_token_ids (vLLM computes them as tokens arrive)
        self.block_hashes: list[BlockHash] = []
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        size = self._block_size
        while (len(self.block_hashes) + 1) * size <= len(self._all_token_ids):
            start = len(self.block_hashes) * size
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.append(hash_block_tokens(parent, self._all_token_ids[start:start + size]))

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        tokens = [token_ids] if isinstance(token_ids, int) else token_ids
        self._output_token_ids.extend(tokens)
        self._all_token_ids.extend(tokens)
        self._update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)
