"""The operations of `test_vllm_random_ops`'s examples, and the engines they run on.

Test helper only: import it after `pytest.importorskip("vllm")`. An example is a list of
operations (`Add`, `Step`, `Drain`, `Abort`, `Reset`, `Delay`, `Fail`, `FailPart`,
`Fault`) that `random_ops_driver.Run` applies to an `Engine`. The operations name transfer
kinds from `KINDS`, re-exported here. Prompts share prefixes of `FAMILIES`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from faulty_worker import KINDS as KINDS  # the kinds `Delay` and `Fail` name
from vllm_engine import KVGroupDef

BLOCK = 16
NUM_FAMILIES = 5
MAX_PREFIX_BLOCKS = 4
FAMILIES = [
    [random.Random(family).randrange(1000, 30000) for _ in range(MAX_PREFIX_BLOCKS * BLOCK)]
    for family in range(NUM_FAMILIES)
]


# --------------------------------------------------------------------------- operations
@dataclass(frozen=True)
class Add:
    """Add `count` requests: `num_blocks` whole blocks of a family's prefix, then a tail."""

    count: int
    family: int
    num_blocks: int
    tail_len: int
    tail_seed: int  # few seeds: equal tails (and so whole equal prompts) recur
    max_tokens: int
    priority: int = 0  # vLLM's (lower first); only the "priority" policy reads it

    def prompts(self) -> list[list[int]]:
        prefix = FAMILIES[self.family][: self.num_blocks * BLOCK]
        prompts = []
        for i in range(self.count):
            tail = random.Random(self.tail_seed + i)
            prompts.append(prefix + [tail.randrange(1000, 30000) for _ in range(self.tail_len)])
        return prompts


@dataclass(frozen=True)
class Step:
    num_steps: int


@dataclass(frozen=True)
class Drain:
    """Step until vLLM is idle (bounded): what came before is finished and stored."""


@dataclass(frozen=True)
class Abort:
    pick: int  # index into the live requests, sorted by id (mod their number)


@dataclass(frozen=True)
class Reset:
    what: str  # gpu | gpu_running | connector | both


@dataclass(frozen=True)
class Delay:
    """From now on start `kind` jobs `start` polls late and report them `hold` polls late."""

    kind: str
    start: int
    hold: int
    rank: int


@dataclass(frozen=True)
class Fail:
    kind: str
    rank: int


@dataclass(frozen=True)
class FailPart:
    """The rank's next load runs, then reports one of its blocks bad (named)."""

    rank: int


@dataclass(frozen=True)
class Fault:
    """The next step's forward raises on rank `rank` (on every rank: None) under vLLM's
    Model Runner V1 or V2 (`v2`), and vLLM's engine core aborts every request
    (forward_faults.py)."""

    rank: int | None
    v2: bool = False


# --------------------------------------------------------------------------- one run
@dataclass(frozen=True)
class Engine:
    """One engine configuration the examples of a test run on."""

    name: str
    store_mode: str = "eager"
    cascade: str | None = None
    disk_only: bool = False  # the one tier is a disk (no CPU tier)
    num_ranks: int = 1
    async_batches: int = 0  # 0: vLLM's Scheduler; else AsyncScheduler, steps in flight
    events: bool = False  # publish KV events (stored-block payloads in eager mode)
    kv_groups: tuple[KVGroupDef, ...] = ()  # a hybrid model's groups (vllm_engine)
    num_gpu_blocks: int = 16
    fine_grained_hits: bool = False  # hits may end inside a block of a larger block size
    scheduling_policy: str = "fcfs"  # vLLM's: "fcfs" or "priority" (`Add.priority`)
    multi: tuple[str, ...] | None = None  # kvtier in a MultiConnector (multi_connector.py)
    eagle: bool = False  # vLLM runs an EAGLE speculative config (HarnessConfig.eagle)
    drafts: int = 0  # with eagle: a fake drafter's tokens a step (HarnessConfig.drafts)
    policy: str = "lru"  # the tiers' policy, EVICTION[+ADMISSION] (kvtier's "policy" key)
    token_check: bool = False  # kvtier tags stores and checks hits' tokens (eager only)
    num_cpu_blocks: int = 25  # the CPU tier's slots (7 with a cascade)
    prefix_match_unit: int | None = None  # vLLM's hash block size (HarnessConfig's)
