"""A host-written counter the device stream waits on: work enqueued now that may only run once
a host thread has finished something (a step's token masks, filled while the loop goes on).

On CUDA the wait is a stream memory operation (`cuStreamWaitValue64`, through the driver
library): the stream holds until the pinned counter reaches the value, without a host sync
and without occupying an SM. Elsewhere (or if the driver lacks the call) the host waits.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable

import torch

_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int64) *addr >= value


@functools.cache
def _driver_wait() -> Callable[[int, int, int, int], int] | None:
    """cuStreamWaitValue64(stream, addr, value, flags), or None without a CUDA driver that
    has it."""
    if not torch.cuda.is_available():
        return None
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    for name in ("cuStreamWaitValue64_v2", "cuStreamWaitValue64"):
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
            fn.restype = ctypes.c_int
            return fn  # type: ignore[no-any-return]
    return None


class HostFlag:
    """A monotonically raised int64 counter in pinned host memory (pinned when CUDA is
    present): `raise_to` from any thread, `device_wait` enqueues a wait for a value on the
    current stream, `host_wait` blocks the calling thread."""

    def __init__(self) -> None:
        self._value = torch.zeros(1, dtype=torch.int64, pin_memory=torch.cuda.is_available())
        self._raised = 0  # the counter as a Python int: a wait that finds it there is a read
        self._cond = threading.Condition()

    def raise_to(self, value: int) -> None:
        with self._cond:
            self._value[0] = value  # written after everything the waiter reads (x86: in order)
            self._raised = value
            self._cond.notify_all()

    def host_wait(self, value: int) -> None:
        if self._raised >= value:
            return
        with self._cond:
            self._cond.wait_for(lambda: self._raised >= value)

    def device_wait(self, value: int, device: torch.device) -> bool:
        """Make `device`'s current stream wait for `value` (False: not possible here; the
        caller waits on the host instead)."""
        fn = _driver_wait() if device.type == "cuda" else None
        if fn is None:
            return False
        stream = torch.cuda.current_stream(device).cuda_stream
        err = fn(stream, self._value.data_ptr(), value, _WAIT_GEQ)
        if err != 0:
            raise RuntimeError(f"cuStreamWaitValue64 failed with CUDA driver error {err}")
        return True
