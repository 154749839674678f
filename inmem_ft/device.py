"""Every device specific of inmem_ft: which tensors live on an accelerator, its streams and events, and host
memory the device can copy to and from by DMA. The rest of the package asks here, so that CUDA, ROCm (which
reports as cuda), XPU and any other torch.accelerator backend take the same path.

Streams and events are torch.Stream / torch.Event through torch.accelerator. Only the registration of host
memory with the device (cudaHostRegister, so that a slot's existing mapping is DMA-able without a second
copy) is CUDA's alone; elsewhere `register` declines and the copy goes through pageable memory.
"""
from __future__ import annotations

import contextlib
import logging
import threading

import torch

log = logging.getLogger("inmem_ft.device")

# Registered memory must start and end on page boundaries (cudaHostRegister rounds them itself otherwise, and
# then a neighbouring range cannot be registered).
PAGE = 4096
_PORTABLE = 1  # cudaHostRegisterPortable: usable from every CUDA context of the process


def kind(value) -> str | None:
    """The accelerator type of a tensor in accelerator memory ("cuda", "xpu"), else None."""
    return value.device.type if accelerated(value) else None


def accelerated(value) -> bool:
    """A tensor in accelerator memory: its bytes leave through a stream. Host and meta tensors are not."""
    return isinstance(value, torch.Tensor) and value.device.type not in ("cpu", "meta")


def ready_event(device: torch.device) -> torch.Event:
    """An event recorded now on the calling thread's current stream of `device`: what a side stream waits on
    so that it reads the tensors as of this point, and not whatever the training stream queues after it."""
    event = torch.Event(device)
    event.record(torch.accelerator.current_stream(device))
    return event


def side_stream(device: torch.device) -> torch.Stream:
    return torch.Stream(device)


@contextlib.contextmanager
def on_stream(stream: torch.Stream):
    """Make `stream` the calling thread's current stream of its device (and that device current) for the
    block: the kernels and copies the block launches queue there."""
    before_index = torch.accelerator.current_device_index()
    torch.accelerator.set_device_index(stream.device_index)
    before = torch.accelerator.current_stream(stream.device_index)
    torch.accelerator.set_stream(stream)
    try:
        yield
    finally:
        torch.accelerator.set_stream(before)
        torch.accelerator.set_device_index(before_index)


def done_event(stream: torch.Stream) -> torch.Event:
    event = torch.Event(stream.device)
    event.record(stream)
    return event


def wait_on_current(event: torch.Event, device: torch.device) -> None:
    """The calling thread's current stream of `device` waits for `event` on the device; the host does not."""
    torch.accelerator.current_stream(device).wait_event(event)


def keep_for(tensor: torch.Tensor, stream: torch.Stream) -> None:
    """`tensor`'s memory is not reused by the caching allocator before the work queued on `stream` so far is
    done, even if its owner drops it meanwhile (the optimizer replacing a buffer)."""
    tensor.record_stream(stream)


class Registration:
    """Host memory [address, address + size) registered with the device, until release()."""

    def __init__(self, address: int, size: int):
        self.address, self.size = address, size

    def release(self) -> None:
        if self.size:
            # Unregistering memory a copy is still using is undefined: callers release after their work ended.
            _in_own_thread(torch.cuda.cudart().cudaHostUnregister, self.address)
            self.size = 0


def register(address: int, size: int) -> Registration | None:
    """Register host memory the process already maps (a snapshot slot) with the device, so that copies from
    and to it are real DMA, overlapped with the host; None where the device cannot (no CUDA, or the driver
    refused: the copy then goes through pageable memory, slower but correct). Costs about 0.1 s per GB:
    never on the training thread."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized() or size <= 0:
        return None
    lo = address // PAGE * PAGE
    hi = -(-(address + size) // PAGE) * PAGE
    cudart = torch.cuda.cudart()
    rc = _in_own_thread(cudart.cudaHostRegister, lo, hi - lo, _PORTABLE)
    if int(rc) != 0:
        log.warning("device event=register_failed bytes=%d error=%s: copies to and from this slot go through "
                    "pageable memory; raise the locked-memory limit (ulimit -l) for full speed", hi - lo,
                    cudart.cudaGetErrorString(rc))
        return None
    return Registration(lo, hi - lo)


def _in_own_thread(call, *args):
    """call(*args) on a thread that ends after it. A failed CUDA runtime call leaves its error pending in the
    calling thread (cudaGetLastError returns it until read, and torch's bindings expose no way to read it), and
    torch's next launch check on that thread would raise it against an unrelated kernel; a thread of its own
    takes the pending error with it."""
    out = {}

    def run():
        try:
            out["rc"] = call(*args)
        except BaseException as e:  # raised on the caller's thread below
            out["error"] = e

    worker = threading.Thread(target=run, name="inmem_ft-host-register")
    worker.start()
    worker.join()
    if "error" in out:
        raise out["error"]
    return out["rc"]


class Upload:
    """Host tensors copied into fresh tensors on the accelerator by non-blocking copies, queued on the current
    stream so that the host meanwhile does other work (a restore verifies the checksums); wait() before the
    host memory they read is released or their bytes are trusted."""

    def __init__(self):
        self._kind = torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else None
        self._used: set[torch.device] = set()

    def __call__(self, host: torch.Tensor, kind: str) -> torch.Tensor:
        """`host` on the current accelerator if it is of `kind` (where the tensor lived when saved), else
        `host` itself (a GPU snapshot restored on a host without that accelerator stays in host memory)."""
        if kind != self._kind:
            return host
        d = torch.device(kind, torch.accelerator.current_device_index())
        out = torch.empty(host.shape, dtype=host.dtype, device=d)
        out.copy_(host, non_blocking=True)
        self._used.add(d)
        return out

    def wait(self) -> None:
        for d in self._used:
            torch.accelerator.current_stream(d).synchronize()


def rng_states() -> dict:
    """The accelerator's generator states, one per device, keyed by its type ("cuda"), if it is in use."""
    backend = _backend()
    if backend is None or not backend.is_initialized():
        return {}
    return {torch.accelerator.current_accelerator().type: backend.get_rng_state_all()}


def set_rng_states(state: dict) -> None:
    backend = _backend()
    kind = torch.accelerator.current_accelerator().type if backend is not None else None
    if kind in state:
        backend.set_rng_state_all([s.clone() for s in state[kind]])


def initialized() -> bool:
    """Whether this process holds an accelerator context: a fork of it could not use the device. Asks each
    backend torch has without starting one (torch.accelerator.is_available() may probe the driver)."""
    return any(getattr(getattr(torch, name, None), "is_initialized", lambda: False)() for name in ("cuda", "xpu"))


def _backend():
    """torch's module of the accelerator (torch.cuda, torch.xpu), or None without one."""
    if not torch.accelerator.is_available():
        return None
    return getattr(torch, torch.accelerator.current_accelerator().type, None)
