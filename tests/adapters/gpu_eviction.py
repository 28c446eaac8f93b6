"""Evicting prompts from vLLM's GPU prefix cache in tests, whatever the copy timing.

A fixed number of filler requests evicts a prompt's blocks only when the workers' copies
are reported in time: a store in flight pins its GPU block, which goes to the free
queue's MRU end once reported, so a report two steps late (a CPU-starved copy thread)
left the prompts' first blocks on the GPU after six fillers, and they came back as local
hits, none from the tier. `evict_from_gpu` runs fillers until vLLM's own prefix lookup
finds nothing of the prompts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from vllm.v1.request import Request
from vllm_harness import VllmHarness, shared_prefix_prompts

# Unrelated prompts (6 blocks of 16, or 2 of 64, each), run one at a time.
FILLERS = shared_prefix_prompts(30, prefix_len=80, suffix_len=3, num_prefixes=30, seed=7)
Prompts = Mapping[str, list[int]]


def gpu_hit_tokens(harness: VllmHarness, request: Request) -> int:
    """Return the tokens of a request's prompt that vLLM's GPU prefix cache holds now
    (the lookup of its admission, `get_computed_blocks`)."""
    coordinator = harness.scheduler.kv_cache_manager.coordinator
    hit = coordinator.find_longest_cache_hit(request.block_hashes, request.num_prompt_tokens - 1)
    return int(hit[1])


def evict_from_gpu(
    harness: VllmHarness,
    request_ids: Iterable[str],
    run: Callable[[Prompts], object] | None = None,
    fillers: Prompts = FILLERS,
) -> list[str]:
    """Run `fillers` one at a time with `run` (`harness.run_requests` by default) until
    vLLM's GPU prefix cache holds nothing of the named requests' prompts; return the ids
    of the fillers run. Fails if all of them leave some of it there."""
    requests = [harness.requests[r] for r in request_ids]  # fillers may reuse the ids
    run = run or harness.run_requests
    ran: list[str] = []
    for request_id, prompt in fillers.items():
        if not any(gpu_hit_tokens(harness, request) for request in requests):
            return ran
        run({request_id: prompt})
        ran.append(request_id)
    hits = [gpu_hit_tokens(harness, request) for request in requests]
    assert not any(hits), f"{len(ran)} fillers left {hits} prompt tokens on the GPU"
    return ran
