"""`pin_host_memory` / `unpin_host_memory` against a fake `cudart` (no GPU here): what
they pass to CUDA, and errors that name the CUDA code, the address and the byte size."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvtier.transfer.device import pin_host_memory, unpin_host_memory


class FakeCudart:
    """Records the calls and answers each with `code`."""

    def __init__(self, code: int) -> None:
        self.code = code
        self.calls: list[tuple[object, ...]] = []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802
        self.calls.append(("register", ptr, nbytes, flags))
        return self.code

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append(("unregister", ptr))
        return self.code


def fake_cudart(monkeypatch: pytest.MonkeyPatch, code: int) -> FakeCudart:
    cudart = FakeCudart(code)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    return cudart


def test_pinning_registers_the_tensor_bytes_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    cudart = fake_cudart(monkeypatch, 0)
    tensor = torch.zeros(3, 5, dtype=torch.float32)
    pin_host_memory(tensor)
    unpin_host_memory(tensor)
    ptr = tensor.data_ptr()
    assert cudart.calls == [("register", ptr, 60, 1), ("unregister", ptr)]


@pytest.mark.parametrize("action", [pin_host_memory, unpin_host_memory])
def test_a_cuda_error_names_the_code_the_address_and_the_size(
    monkeypatch: pytest.MonkeyPatch, action: Callable[[torch.Tensor], None]
) -> None:
    """Regression: a failed unpin named only the CUDA error code (and a failed pin no
    address), so the log could not tell which of a worker's regions it was."""
    fake_cudart(monkeypatch, 712)  # cudaErrorHostMemoryAlreadyRegistered
    tensor = torch.zeros(4, 6, dtype=torch.float16)
    expected = rf"of 48 B at {tensor.data_ptr():#x} failed with CUDA error 712"
    with pytest.raises(RuntimeError, match=expected):
        action(tensor)
