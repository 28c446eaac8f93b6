"""Payloads of tier events vLLM's GPU events carry too, with 64-token blocks hashed every
16 tokens: an eager store's secondary keys (fine-grained partial entries), and a
cascade's demotions to disk, compared to vLLM's own GPU events for the same hashes."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.block_pool import BlockPool as VllmBlockPool
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.request import Request
from vllm_event_fixtures import HBS, LAYOUT, SIZE, TRANSLATOR, by_hash, gpu_pool
from vllm_event_fixtures import make_request as make_sized_request

from kvtier.adapters.vllm.views import VllmGpuPoolView, VllmRequestView
from kvtier.core.block_pool import BlockPool
from kvtier.core.keys import make_key
from kvtier.offload.block_payload import secondary_payloads
from kvtier.offload.cascade import Cascade
from kvtier.offload.config import CascadeMode
from kvtier.offload.plan import Tier
from kvtier.offload.registration import Registrar
from kvtier.offload.stats import StepCounters
from kvtier.offload.store_selection import StoreSelector


def make_request() -> Request:
    return make_sized_request(2 * SIZE, cache_salt="salt")  # extra keys on hash block 0


def gpu_with_partial_entries(request: Request) -> tuple[VllmBlockPool, list[Any]]:
    """Two whole blocks, the second also holding two shorter partial entries (vLLM keeps
    them besides its primary hash), and the GPU pool."""
    gpu = gpu_pool()
    blocks = gpu.get_new_blocks(2)
    gpu.cache_full_blocks(request, blocks, 0, 2, SIZE, 0)
    gpu.cache_partial_block(request, blocks[1], SIZE + HBS, 0, SIZE)
    gpu.cache_partial_block(request, blocks[1], SIZE + 3 * HBS, 0, SIZE)
    return gpu, blocks


def stored_in_cpu(
    request: Request, gpu: VllmBlockPool, blocks: list[Any], cpu: BlockPool | None = None
) -> BlockPool:
    """Select the request's blocks as an eager step does, and register the stores."""
    view = VllmGpuPoolView(gpu, (SIZE,))
    cpu = cpu or BlockPool(8, record_events=True, medium=Tier.CPU.value)
    selector = StoreSelector(
        LAYOUT, view, cpu, StepCounters(), record_payload=True, fine_grained=True
    )
    table = [block.block_id for block in blocks]
    for pos in range(len(table)):
        selector._select_position(VllmRequestView(request), 0, table, pos)
    stores = selector.take_queued()
    assert len(stores) == 2
    assert list(stores.secondary_payloads) == [1]
    Registrar(LAYOUT, Tier.CPU, cpu, events=True).register_all(stores, view)
    return cpu


def test_an_eager_store_s_secondary_keys_carry_vllm_s_gpu_payloads() -> None:
    """The partial entries a GPU block held before it filled are stored as secondary
    keys, whose CPU events equal vLLM's GPU events for the same hashes (tokens of their
    last hash block, parent, extra keys)."""
    request = make_request()
    gpu, blocks = gpu_with_partial_entries(request)
    gpu_events = by_hash(gpu.take_events(), "GPU")
    cpu = stored_in_cpu(request, gpu, blocks)
    cpu_events = by_hash(TRANSLATOR.translate_all(cpu.take_events()), "CPU")
    hashes = [maybe_convert_block_hash(h) for h in request.block_hashes]
    assert set(cpu_events) == set(gpu_events) == {hashes[i] for i in (3, 4, 6, 7)}
    for h in (hashes[4], hashes[6]):  # the secondary keys
        assert cpu_events[h] == gpu_events[h]
        assert cpu_events[h][1]  # a payload, not None
    assert cpu_events == gpu_events


def test_a_secondary_key_the_request_does_not_name_gets_no_payload() -> None:
    """Only hashes of the block's own span before its last are the request's partial
    entries: another key (the block's last hash, a hash of another block) has none."""
    request = make_request()
    view = VllmRequestView(request)
    hashes = request.block_hashes
    keys = [make_key(hashes[i], 0) for i in (0, 3, 7)]
    assert secondary_payloads(LAYOUT, view, 0, 1, keys) == ()
    (found,) = secondary_payloads(LAYOUT, view, 0, 1, [*keys, make_key(hashes[5], 0)])
    assert found.block_hash == hashes[5]
    assert found.parent_block_hash == hashes[4]
    assert secondary_payloads(LAYOUT, view, 0, 1, [make_key(hashes[5], 1)]) == ()


@pytest.mark.parametrize("mode", list(CascadeMode))
def test_a_demotion_s_disk_events_carry_the_cpu_events_payloads(mode: CascadeMode) -> None:
    """Demoted to disk, each key (primary and secondary) is published with the payload
    of its CPU event, equal to vLLM's GPU event for the same hash; a CPU block that lost
    its keys and was stored again without a payload demotes none."""
    request = make_request()
    gpu, blocks = gpu_with_partial_entries(request)
    gpu_events = by_hash(gpu.take_events(), "GPU")
    cpu = BlockPool(8, record_events=True, medium=Tier.CPU.value)
    disk = BlockPool(8, record_events=True, medium=Tier.DISK.value)
    registrar = Registrar(LAYOUT, Tier.CPU, cpu, events=True)
    cascade = Cascade(
        cpu, disk, mode, reserve=7, event=lambda k, n: registrar.event(k, n, Tier.DISK)
    )
    stored_in_cpu(request, gpu, blocks, cpu)
    cpu.take_events()
    cpu_ids = [cpu.cached_block(make_key(request.block_hashes[i], 0)) for i in (3, 7)]
    assert None not in cpu_ids
    cpu.free(cpu_ids[::-1])  # registered: the stores' pins go
    # One CPU block loses its keys and holds its key again, stored payload-free (lazy).
    cpu.discard_keys(cpu_ids[0])
    key = make_key(request.block_hashes[3], 0)
    cpu.touch([cpu_ids[0]])
    cpu.insert_key(key, cpu_ids[0], SIZE, registrar.event(key, SIZE))
    cpu.free([cpu_ids[0]])
    if mode is CascadeMode.WRITE_THROUGH:
        cascade.after_stores(cpu_ids)
    else:
        cascade.select_write_back()
    items = cascade.take_queued()
    assert len(items) == 2
    cascade.complete(items, succeeded=True, abandoned=False)
    disk_events = by_hash(TRANSLATOR.translate_all(disk.take_events()), "STORAGE")
    hashes = [maybe_convert_block_hash(h) for h in request.block_hashes]
    assert set(disk_events) == {hashes[i] for i in (3, 4, 6, 7)}
    for i in (4, 6, 7):
        assert disk_events[hashes[i]] == gpu_events[hashes[i]]
    assert disk_events[hashes[3]] == (SIZE, [], None, None)  # unknown, not the old one
