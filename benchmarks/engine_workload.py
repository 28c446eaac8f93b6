"""A seeded request stream for the engine-like loop (`engine_loop`, for benchmarks).

`Workload` / `WorkloadConfig`: prompts of about 2 k tokens, half of them starting with one
of several shared system prefixes of Zipf popularity, 32-256 output tokens. Request `i`
depends only on the seed and `i`, so every mode (offload off, eager, lazy) and any other
engine driven by the same stream (e.g. vLLM's Scheduler) sees the same requests. Prompt
block hashes are computed here, outside any timed region: an engine hashes a prompt when
the request arrives (vLLM: in `Request.__init__`), not in its scheduler step.
"""

from __future__ import annotations

import bisect
import itertools
from array import array
from dataclasses import dataclass

import numpy as np

from kvtier.core.hashing import BlockHasher
from kvtier.core.keys import BlockHash


@dataclass(frozen=True)
class WorkloadConfig:
    """Shape of the request stream. Token counts are per request."""

    seed: int = 0
    block_size: int = 16
    prompt_tokens: int = 2048
    prompt_jitter_tokens: int = 256  # prompt length uniform in prompt_tokens ± this
    shared_fraction: float = 0.5  # share of requests starting with a system prefix
    system_prefix_tokens: int = 1024
    num_system_prefixes: int = 32
    prefix_zipf: float = 1.0  # popularity of system prefix k ∝ 1 / (k + 1) ** zipf
    min_output_tokens: int = 32
    max_output_tokens: int = 256
    vocab_size: int = 32000


@dataclass(frozen=True)
class RequestSpec:
    """One request as it arrives: prompt, its block hashes, the tokens it will sample."""

    request_id: str
    prompt: array  # token ids, array('i')
    prompt_block_hashes: tuple[BlockHash, ...]
    output: array  # the tokens it samples; its length is the number of output tokens


class Workload:
    """Deterministic request specs: spec `i` depends only on the seed and `i` (memoised)."""

    def __init__(self, config: WorkloadConfig, hasher: BlockHasher) -> None:
        if config.system_prefix_tokens % config.block_size:
            raise ValueError("system_prefix_tokens must be a multiple of block_size")
        self.config = config
        self.hasher = hasher
        weights = [(k + 1) ** -config.prefix_zipf for k in range(config.num_system_prefixes)]
        self._prefix_cdf = list(itertools.accumulate(w / sum(weights) for w in weights))
        self._prefixes: dict[int, tuple[array, list[BlockHash]]] = {}
        self._specs: dict[int, RequestSpec] = {}

    def spec(self, index: int) -> RequestSpec:
        """Return request `index` of the stream."""
        spec = self._specs.get(index)
        if spec is None:
            spec = self._specs[index] = self._make(index)
        return spec

    def _tokens(self, rng: np.random.Generator, num_tokens: int) -> array:
        return array("i", rng.integers(0, self.config.vocab_size, num_tokens).tolist())

    def _hash(self, tokens: array, hashes: list[BlockHash]) -> list[BlockHash]:
        """Extend `hashes` (the chain of the first blocks of `tokens`) to every full block."""
        bs = self.config.block_size
        parent = hashes[-1] if hashes else None
        for j in range(len(hashes), len(tokens) // bs):
            parent = self.hasher.hash_block(parent, tokens[j * bs : (j + 1) * bs])
            hashes.append(parent)
        return hashes

    def _system_prefix(self, k: int) -> tuple[array, list[BlockHash]]:
        found = self._prefixes.get(k)
        if found is None:
            rng = np.random.default_rng([self.config.seed, 1, k])
            tokens = self._tokens(rng, self.config.system_prefix_tokens)
            found = self._prefixes[k] = (tokens, self._hash(tokens, []))
        return found

    def _make(self, index: int) -> RequestSpec:
        cfg = self.config
        rng = np.random.default_rng([cfg.seed, 2, index])
        jitter = cfg.prompt_jitter_tokens
        num_prompt = cfg.prompt_tokens + int(rng.integers(-jitter, jitter + 1))
        if rng.random() < cfg.shared_fraction:
            k = min(bisect.bisect(self._prefix_cdf, rng.random()), cfg.num_system_prefixes - 1)
            prefix, prefix_hashes = self._system_prefix(k)
            prompt = prefix + self._tokens(rng, num_prompt - len(prefix))
            hashes = self._hash(prompt, list(prefix_hashes))
        else:
            prompt = self._tokens(rng, num_prompt)
            hashes = self._hash(prompt, [])
        num_output = int(rng.integers(cfg.min_output_tokens, cfg.max_output_tokens + 1))
        return RequestSpec(f"req-{index}", prompt, tuple(hashes), self._tokens(rng, num_output))
