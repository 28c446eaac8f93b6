"""The policy protocols' runtime side (`core/policies/base.py`, `lru.py`): each policy
is named as the configuration chooses it, `AdmitAll` stores everything, and
`RequestObserver` is what the replay tells the request index to."""

from __future__ import annotations

from kvtier.core.keys import make_key
from kvtier.core.policies import (
    ADMISSION_POLICIES,
    EVICTION_POLICIES,
    AdmitAll,
    LRUPolicy,
    RequestObserver,
)


def test_each_policy_s_name_is_the_one_that_chooses_it() -> None:
    """The protocols' `name` is the name the configuration chooses the policy by (the
    keys of `EVICTION_POLICIES` / `ADMISSION_POLICIES`; no `+ADMISSION` is `all`)."""
    for name, make_eviction in EVICTION_POLICIES.items():
        policy = make_eviction(8)
        assert policy.name == name
        policy.check_invariants()
    for name, make_admission in ADMISSION_POLICIES.items():
        admission = make_admission(8)
        assert admission.name == name
        admission.check_invariants()


def test_admit_all_stores_every_candidate() -> None:
    admission = AdmitAll()
    assert all(admission.admit(make_key(bytes([i]) * 32, 0)) for i in range(4))
    admission.check_invariants()


def test_a_policy_with_on_request_is_a_request_observer() -> None:
    """The replay finds the policies to tell each request's index by this isinstance
    check (offline oracles); online policies are not observers."""

    class Oracle:
        def on_request(self, index: int) -> None:
            self.index = index

    assert isinstance(Oracle(), RequestObserver)
    lru = LRUPolicy(8)
    assert not isinstance(lru, RequestObserver)
    lru.check_invariants()
