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

Under asynchronous scheduling (`HarnessConfig.async_scheduling`, at most two steps in
flight) vLLM's scheduler neither receives drafts (its engine core skips
`update_draft_token_ids`) nor knows how many of a step's drafts were accepted when it
schedules the next one: it schedules `-1` placeholders for them after positions that
count every draft of the step in flight as accepted. vLLM's GPU model runner feeds its
own drafts there and moves the request's positions back by the rejections of the
previous step it ran (`correct_spec_decode_token_counts`): `verify` and `shift` do the same
(`shift` is 0 under synchronous scheduling).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fake_kv_cache import chain_fingerprints
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import DraftTokenIds
from vllm.v1.request import Request

if TYPE_CHECKING:  # vllm_engine imports this module
    from vllm_engine import HarnessConfig


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

    @classmethod
    def for_config(cls, cfg: HarnessConfig) -> FakeDrafter | None:
        """Return the drafter of `cfg` (None without `drafts`)."""
        return cls(cfg.drafts, cfg.draft_seed, cfg.async_scheduling) if cfg.drafts else None

    def __init__(self, num_drafts: int, seed: int, async_scheduling: bool = False) -> None:
        self.num_drafts = num_drafts
        self.seed = seed
        self.async_scheduling = async_scheduling
        self.num_proposed = 0  # draft tokens the forward was fed (vLLM's padding too)
        self.num_accepted = 0
        # asynchronous scheduling: request -> (its latest step still in flight, the drafts
        # that step rejected), which the scheduler has not rolled back yet
        self._rejected_in_flight: dict[str, tuple[SchedulerOutput, int]] = {}

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

    def after_step(self, scheduler: Scheduler, step: SchedulerOutput) -> None:
        """vLLM's `post_step` once `step`'s output is processed: give the scheduler drafts
        for the requests it ran (synchronous scheduling), or forget its rejections, which
        the scheduler has rolled back (asynchronous)."""
        if self.async_scheduling:
            for request_id, (entry_step, _) in list(self._rejected_in_flight.items()):
                if entry_step is step:
                    del self._rejected_in_flight[request_id]
        elif step.num_scheduled_tokens:
            ran = [scheduler.requests.get(r) for r in step.num_scheduled_tokens]
            scheduler.update_draft_token_ids(self.propose(r for r in ran if r))

    def verify(
        self, request_id: str, end: int, scheduled: Sequence[int], step: SchedulerOutput
    ) -> tuple[list[int], list[int]]:
        """Return the drafts the forward feeds at positions `end..` for the `scheduled`
        ones (asynchronous scheduling: placeholders, filled with the runner's own), and
        what the rejection sampler returns for them: the leading right drafts, then the
        bonus token. Under asynchronous scheduling, remember the rejections until
        `step`'s output is processed."""
        drafts = list(scheduled)
        if self.async_scheduling and all(token == -1 for token in scheduled):
            drafts = [self.draft_at(request_id, end + i) for i in range(len(scheduled))]
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == token_at(request_id, end + accepted):
            accepted += 1
        self.num_proposed += len(drafts)
        self.num_accepted += accepted
        if self.async_scheduling:
            self._rejected_in_flight[request_id] = (step, len(drafts) - accepted)
        return drafts, [*drafts[:accepted], token_at(request_id, end + accepted)]

    def shift(self, request_id: str, resumed: bool) -> int:
        """Return how far the forward moves a request's positions back from the
        scheduler's: the drafts its step still in flight rejected (none for a new or
        resumed request, which vLLM's runner adds afresh)."""
        entry = self._rejected_in_flight.pop(request_id, None)
        return 0 if entry is None or resumed else entry[1]

    @staticmethod
    def draft_prints(prints: Sequence[int], drafts: Sequence[int]) -> list[int]:
        """Return the fingerprints the forward writes at the draft positions after the
        prefix of `prints`: each of the prefix ending in the draft fed there."""
        return chain_fingerprints(prints[-1], drafts)
