"""The TTFT cost model's documented defaults (docs/policies.md, replay/cost.py): 10,000
prefill tokens/s and 128 KiB of KV per token (Llama-3-8B in bf16)."""

from __future__ import annotations

from kvtier.replay.cost import CostModel


def test_the_default_cost_model_recomputes_ten_thousand_tokens_a_second() -> None:
    """A mutant defaulting to 1,000 tokens/s passed every test: none read the default."""
    cost = CostModel()
    assert cost.prefill_s(25_000) == 2.5
    assert cost.bytes_per_token == 32 * 8 * 128 * 2 * 2 == 131_072
