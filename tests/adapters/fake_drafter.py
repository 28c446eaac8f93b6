"""The harness's speculative decoding: vLLM's config stand-in, a fake drafter and the
rejection sampler (test helper).

With `HarnessConfig.drafts` = k (an EAGLE config), after each step the drafter proposes
k draft tokens for every request the step ran, as a real model runner's drafter does
(`take_draft_token_ids`); vLLM's scheduler keeps them for decoding requests
(`update_draft_token_ids`) and schedules them after the last token. Whether the draft
at a position is right (the model's token there, `token_at`) is a seeded hash of the
request and position: about a third are wrong.

The fake forward feeds a draft position its draft token, so it writes the KV of the
prefix ending in that token: a wrong draft's position, and every later draft position of
that step, hold KV of another prefix until a later step rewrites them. It samples what
vLLM's rejection sampler returns: the leading right drafts, then one bonus token (the
model's token at the first wrong draft's position, or past the last draft); vLLM rolls
`num_computed_tokens` back over the rejected ones.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fake_kv_cache import chain_fingerprints
from vllm.v1.outputs import DraftTokenIds
from vllm.v1.request import Request


@dataclass(frozen=True)
class EagleStandIn:
    """vLLM's `SpeculativeConfig` as its scheduler reads it, for an EAGLE drafter.

    A real one needs a draft model; without `HarnessConfig.drafts` the harness proposes
    no draft tokens, so only the cache behaviour EAGLE turns on is exercised (the
    last-block drop of prefix hits, the Mamba checkpoint one block earlier, the lookahead
    slot).
    """

    method: str = "eagle"
    num_speculative_tokens: int = 1
    num_speculative_tokens_per_batch_size: None = None
    disable_eagle_block_drop: bool = False
    disable_lookahead_block_hashes: bool = False
    max_num_new_slots_for_drafting: int = 0  # EAGLE: no query rows beyond the target's

    def use_eagle(self) -> bool:
        return True

    def needs_eagle_block_drop(self) -> bool:
        return True

    def use_eagle_block_drop(self) -> bool:
        return True

    def use_dflash(self) -> bool:
        return False

    def use_dspark(self) -> bool:
        return False

    def use_multi_module_mtp(self) -> bool:
        return False

    def uses_draft_model(self) -> bool:
        return False


def token_at(request_id: str, position: int) -> int:
    """The fake model's token at `position`: request-specific (outputs diverge), and
    deterministic."""
    return 100 + (zlib.crc32(request_id.encode()) + position) % 1000


class FakeDrafter:
    """Proposes `num_drafts` tokens per request, a seeded mix of right and wrong ones."""

    def __init__(self, num_drafts: int, seed: int) -> None:
        self.num_drafts = num_drafts
        self.seed = seed
        self.num_proposed = 0  # draft tokens the forward was fed (vLLM's padding too)
        self.num_accepted = 0

    def draft_at(self, request_id: str, position: int) -> int:
        """Return the draft token proposed for `position`: right or, seeded, wrong."""
        right = token_at(request_id, position)
        mix = zlib.crc32(f"{self.seed}:{request_id}:{position}".encode())
        return right if mix % 3 else right + 1 + mix % 7

    def propose(self, requests: Iterable[Request]) -> DraftTokenIds:
        """Return drafts for the positions after each request's last token."""
        req_ids, drafts = [], []
        for request in requests:
            end = request.num_tokens
            req_ids.append(request.request_id)
            drafts.append(
                [self.draft_at(request.request_id, end + i) for i in range(self.num_drafts)]
            )
        return DraftTokenIds(req_ids, drafts)

    def sample(self, request_id: str, end: int, drafts: Sequence[int]) -> list[int]:
        """Return what the rejection sampler returns for `drafts` at positions `end..`:
        the leading right drafts, then the bonus token."""
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == token_at(request_id, end + accepted):
            accepted += 1
        self.num_proposed += len(drafts)
        self.num_accepted += accepted
        return [*drafts[:accepted], token_at(request_id, end + accepted)]

    @staticmethod
    def draft_prints(prints: Sequence[int], drafts: Sequence[int]) -> list[int]:
        """Return the fingerprints the forward writes at the draft positions after the
        prefix of `prints`: each of the prefix ending in the draft fed there."""
        return chain_fingerprints(prints[-1], drafts)
