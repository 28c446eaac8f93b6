"""`RMSNorm` rounds as Hugging Face's Llama norm does in a low-precision model.

The normalised activations are computed in float32, cast back to the model's dtype, and
only then scaled by the weight (in that dtype): scaling in float32 and casting once
rounds differently, and a bfloat16 checkpoint's outputs drift from the reference.
"""

from __future__ import annotations

import torch

from kvtier.engine.model import RMSNorm


def test_a_bfloat16_norm_scales_after_casting_back() -> None:
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(64, 1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=gen) * 3)
    x = (torch.randn(32, 64, generator=gen) * 5).bfloat16()
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    with torch.no_grad():
        out = norm(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, norm.weight * normed)
