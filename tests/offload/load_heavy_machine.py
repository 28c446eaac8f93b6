"""Load-heavy runs of the offload scheduler's stateful test: the load path, often (SPEC §6).

`LoadHeavy` reshapes `SchedulerMachine`'s workload (and its disk-tier variants') so that
loads are common (about 1 lookup in 5 queues one; 1 in 40 tier hits there): the tiers
start with every prefix stored (`warm_up`, again after a reset), a GPU pool barely
larger than one request that is evicted every other step (so hits come from the tier),
three short prefixes most requests reuse, tiers large enough to keep them, loads that
linger in flight over steps and complete, fail whole or fail naming corrupted slots in
any order, loading requests aborted often, and request ids reused often (some while the
earlier request's load is still in flight).

On top of the model checks it inherits, it checks after every step the KV the engine
would compute from (`kv_is_right`):

- every request holding GPU blocks and not waiting for a load has, in every block it
  reads up to its computed tokens, the KV of its own prefix at that position, on every
  worker (the blocks it was told were loaded, and those of its local hit);
- every GPU block cached under a key holds that key's KV on every worker (but blocks a
  failed forward left behind, which the engine frees with their keys, as vLLM does).

The lower tiers' slots are checked by the inherited `visible_keys_were_stored_by_every_worker`.
`LoadTally` counts lookups, queued loads and load outcomes, for a campaign to report.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

from disk_tier_machines import RestoredDiskMachine
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule
from scheduler_model_checks import SchedulerMachine
from scheduler_setup import EXTRAS, FAMILIES, HASH_BLOCK, POLICIES, SEEDS, SETUP_ARGS
from sim import make_request

from kvtier.core.block_pool import NULL_BLOCK_ID
from kvtier.core.keys import Key
from kvtier.core.kv_groups import GroupKind
from kvtier.offload.config import StoreMode
from kvtier.offload.plan import TransferJob

# The two families the restored disks know, and one more: three prefixes of 3 hash blocks.
PREFIXES = [*FAMILIES, [2000 + i for i in range(12)]]
MAX_SUFFIX_TOKENS = 3
MAX_OUTPUTS = 2
MAX_REQUEST_TOKENS = len(PREFIXES[0]) + MAX_SUFFIX_TOKENS + MAX_OUTPUTS
# Loads linger (waits), and fail whole or naming corrupted slots more often than stores.
LOAD_ACTIONS = ["done"] * 8 + ["wait"] * 4 + ["fail", "corrupt"]
LOAD_SETUP_ARGS = {
    **SETUP_ARGS,
    "num_gpu_blocks": st.just(0),  # unused: `gpu_slack` sizes the GPU pool
    "gpu_slack": st.integers(0, 3),
    "num_tier_blocks": st.integers(16, 32),
    "num_disk_blocks": st.integers(16, 32),
    "disk_seed": SEEDS,
    # LRU and admit-all three times in four: other admission policies keep prefixes out.
    "policy": st.sampled_from(POLICIES + [("lru", "all")] * len(POLICIES)),
}


class LoadTally:
    """Counts of one campaign's lookups and loads, over every example of a machine."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def loads_per_lookup(self) -> float:
        """Return the queued loads per lookup (0.0 before any lookup)."""
        return self.counts["queued loads"] / max(1, self.counts["lookups"])


def num_gpu_blocks_for(block_size: int, second: GroupKind | str | None, slack: int) -> int:
    """Return a GPU pool that holds one longest request, plus `slack` blocks and the null
    block, for the layout `SchedulerSetup.setup` builds from `block_size` and `second`."""
    num_blocks = -(-MAX_REQUEST_TOKENS // block_size)
    num_other_groups = 2 if second == "both" else int(second is not None)
    return 1 + num_blocks + num_other_groups * -(-MAX_REQUEST_TOKENS // HASH_BLOCK) + slack


class LoadHeavy(SchedulerMachine):
    """Mix in before a `SchedulerMachine` class: its runs, reshaped to load often."""

    tally: LoadTally | None = None  # a campaign sets one to count loads

    @initialize(**LOAD_SETUP_ARGS)
    def setup(self, gpu_slack: int, disk_seed: int, **kwargs: Any) -> None:
        """Size the GPU pool to one request plus `gpu_slack` blocks; the rest as drawn."""
        fine = kwargs["fine"] and self.mode is StoreMode.EAGER
        block_size = 2 * HASH_BLOCK if fine else HASH_BLOCK
        kwargs["num_gpu_blocks"] = num_gpu_blocks_for(block_size, kwargs["second"], gpu_slack)
        note(f"GPU pool of {kwargs['num_gpu_blocks']} blocks")
        self.warm = False  # the tiers hold the prefixes (`warm_up`)
        self.failed_forward: dict[int, Key] = {}  # GPU block -> its key when the forward failed
        restored = (disk_seed,) if isinstance(self, RestoredDiskMachine) else ()
        super().setup(*restored, **kwargs)

    # ------------------------------------------------------------ workload

    @rule(seed=SEEDS)
    def step(self, seed: int) -> None:
        """The driver's step, after evicting the GPU cache half the time (a hit must
        come from the tier); the first one, and the first after a reset with no
        request holding GPU blocks, stores every prefix first (`warm_up`)."""
        if not self.warm and not self.engine.requests:
            self.warm_up()
        if random.Random(seed).randrange(2):
            note("evict the GPU cache")
            self.engine.evict_gpu()
        super().step(seed >> 1)

    def warm_up(self) -> None:
        """Run a request of each whole prefix alone to its end and store it, completing
        every transfer: the tiers start with the prefixes (runs would spend most steps
        filling them); twice under an admission policy that admits a key seen before.
        Hits found on the way are declined, so that no load is queued."""
        engine = self.engine
        passes = 1 if engine.scheduler.config.admission_policy == "all" else 2  # seen twice
        for prefix in PREFIXES * passes:
            request = make_request(self.fresh_request_id(), prefix, HASH_BLOCK)
            note(f"warm up: {request.request_id} runs {prefix} alone")
            if engine.admit(request, 0) is None:  # in-flight transfers pin GPU blocks
                note(f"warm up: no room for {request.request_id}")
                engine.scheduler.release_lookup(request.request_id)
                continue
            num_tokens = request.num_tokens - request.num_computed_tokens
            if not engine.gpu.can_allocate(
                engine.num_blocks_to_schedule(request.request_id, num_tokens)
            ):
                note(f"warm up: no room for the rest of {request.request_id}")
                engine.finish(request.request_id)
                continue
            engine.schedule(request.request_id)
            self.run_step()
            engine.finish(request.request_id)
            for _ in range(2):  # the finish's stores (lazy: those of the freed blocks)
                self.run_step()
                self.complete_all()
                self.poll()
        self.warm = True

    def arrive(self, rng: random.Random) -> None:
        """A request arrives: mostly a whole shared prefix, a short suffix, few outputs."""
        prefix = PREFIXES[rng.randrange(len(PREFIXES))]
        prefix = prefix[: HASH_BLOCK * rng.choice([1, 2, 3, 3, 3])]
        num_suffix_tokens = rng.randint(1, MAX_SUFFIX_TOKENS)  # the whole prefix is looked up
        tokens = prefix + [rng.randrange(2) for _ in range(num_suffix_tokens)]
        outputs = [rng.randrange(2) for _ in range(rng.randrange(MAX_OUTPUTS + 1))]
        skip = rng.randrange(20) == 0
        lora, extras = rng.choice(EXTRAS) if rng.randrange(4) == 0 else EXTRAS[0]
        request_id = self.new_request_id(rng)
        note(f"arrive {request_id}: {tokens} then {outputs}{' (skips the cache)' * skip}")
        self.waiting[request_id] = make_request(
            request_id,
            tokens,
            HASH_BLOCK,
            outputs=outputs,
            lora=lora,
            extras=extras,
            skip_prefix_cache=skip,
        )

    def new_request_id(self, rng: random.Random) -> str:
        """Reuse a finished request's id a third of the time."""
        live = set(self.live_ids())
        gone = [f"r{i}" for i in range(self.next_id) if f"r{i}" not in live]
        if gone and rng.randrange(3) == 0:
            return rng.choice(gone)
        return self.fresh_request_id()

    def fresh_request_id(self) -> str:
        """Return a request id never used before."""
        self.next_id += 1
        return f"r{self.next_id - 1}"

    def reset(self) -> None:
        """Reset as the driver does; the tiers are empty: warm them up again."""
        super().reset()
        self.warm = False

    def admit(self, request_id: str, rng: random.Random) -> None:
        """Admit as the driver does; count the lookup and whether it queued a load."""
        super().admit(request_id, rng)
        if self.tally is not None:
            self.tally.counts["lookups"] += 1
            self.tally.counts["queued loads"] += request_id in self.queued_loads

    def incident(self, incident: int, rng: random.Random) -> None:
        """Besides the driver's incidents, abort a loading request (then, sometimes, a
        new one takes its id) on three turns in ten; reset a quarter as often (a reset
        empties the tiers: the runs would go on with few hits)."""
        loading = sorted(self.engine.loading)
        if incident in (4, 5, 6) and loading:
            self.abort(rng.choice(loading), rng.randrange(4) != 0, rng)
            return
        if incident == 1 and rng.randrange(4):
            incident = 2  # a report instead
        super().incident(incident, rng)

    def abort(
        self, request_id: str, computed: bool = True, rng: random.Random | None = None
    ) -> None:
        """Abort as the driver does; remember the keyed blocks a failed forward left."""
        engine = self.engine
        if not computed and not self.admitted and request_id in engine.requests:
            for block_id, _ in engine.last_forward.get(request_id, ()):
                key = engine.gpu.key(block_id)
                if key is not None:
                    self.failed_forward[block_id] = key
        super().abort(request_id, computed, rng)

    def worker_actions(self, job: TransferJob) -> list[str]:
        """Loads linger and fail more; other jobs as the machine's own actions."""
        return LOAD_ACTIONS if job.is_load else super().worker_actions(job)

    def teardown(self) -> None:
        """Drain as the machine does; add the load outcomes to the tally."""
        super().teardown()
        if self.tally is None or not hasattr(self, "engine"):
            return
        for flight in self.engine.worker.reported.values():
            if flight.job.is_load:
                self.tally.counts["failed load jobs" if flight.failed else "done load jobs"] += 1

    # ------------------------------------------------------------ checks

    @invariant()
    def kv_is_right(self) -> None:
        """Every block a request reads, and every cached GPU block, holds the right KV."""
        engine = self.engine
        for request_id, request in sorted(engine.requests.items()):
            if request_id not in engine.loading:
                engine.check_kv(request)
        for block_id in range(NULL_BLOCK_ID + 1, engine.gpu.num_blocks):
            key = engine.gpu.key(block_id)
            if key is None:
                self.failed_forward.pop(block_id, None)
                continue
            if self.failed_forward.get(block_id) == key:
                continue  # what a failed forward left: never hit (`SimEngine.cached_block`)
            for worker, gpu in enumerate(engine.worker.gpu):
                assert key in engine.covered.get(gpu.get(block_id), ()), (
                    f"GPU block {block_id} cached under a key holds other KV on worker {worker}"
                )
