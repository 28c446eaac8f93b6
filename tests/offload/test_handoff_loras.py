"""A hand-off's store carries no token payload (SPEC §6.10), but its event names the LoRA
adapter of the request that handed the block off, as vLLM's GPU event of its key does."""

from __future__ import annotations

import hashlib

import pytest
from sim_request import make_request

from kvtier.core.block_pool import BlockPool
from kvtier.core.keys import make_key
from kvtier.core.kv_groups import KVLayout
from kvtier.offload.plan import Tier
from kvtier.offload.protocols import Handoff, LoRAInfo, ScheduledRequest, StepInput
from kvtier.offload.registration import Registrar
from kvtier.offload.stats import StepCounters
from kvtier.offload.store_selection import StoreSelector

LAYOUT = KVLayout.single(4, 64)
ADAPTER = LoRAInfo(7, "adapter-7")


@pytest.mark.parametrize("lora", [ADAPTER, None], ids=["adapter", "base"])
@pytest.mark.parametrize("tracked", [True, False], ids=["eager", "lazy"])
def test_a_hand_off_s_event_names_its_request_s_adapter(
    lora: LoRAInfo | None, tracked: bool
) -> None:
    gpu = BlockPool(4)
    (block,) = gpu.allocate(1)
    key = make_key(hashlib.sha256(b"handed off").digest(), 0)
    gpu.insert_key(key, block, 4)
    tier = BlockPool(4, record_events=True, medium=Tier.CPU.value)
    selector = StoreSelector(
        LAYOUT, gpu, tier, StepCounters(), record_payload=False, fine_grained=False
    )
    request = make_request("r", range(8), lora=lora)
    step = StepInput(scheduled=(ScheduledRequest(request, ([block],), 4),))
    if tracked:  # eager mode: the request as the plan last scheduled it
        selector.track("r")
        selector.tracked["r"].view = request
    selector.select_handoffs(
        [Handoff("r", 0, block)], frozenset(), require_tracked=tracked, step=step
    )
    stores = selector.take_queued()
    assert stores.keys == [key]
    Registrar(LAYOUT, Tier.CPU, tier, events=True).register_all(stores, gpu)
    (event,) = tier.take_events()
    assert event.block_hash == hashlib.sha256(b"handed off").digest()
    assert (event.lora_id, event.lora_name) == ((7, "adapter-7") if lora else (None, None))
    assert event.token_ids == ()
