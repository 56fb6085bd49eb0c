"""Sleeping on a word of shared memory until another process changes it: a Linux futex.

A rank that waits for a peer's message without spinning used to sleep in ``time.sleep`` steps,
and each sleep ends up to ~100 us after it was due (timer slack plus a VM's timer): a micro-batch
thread, which must not spin (it would keep the GIL from the thread computing the other
micro-batch), heard its reply a sleep late. ``FUTEX_WAIT`` on the awaited word sleeps
until the writer's ``FUTEX_WAKE``, and ctypes releases the GIL for the call. The kernel compares
the word with the value the waiter last saw before it sleeps, so a message posted between the
waiter's look and its sleep is never slept through. The futexes are shared ones (no
``FUTEX_PRIVATE_FLAG``): the word is in a file mapping of two processes.

Elsewhere than Linux on x86-64 or AArch64, :data:`AVAILABLE` is False and waits sleep as before.
"""

from __future__ import annotations

import ctypes
import mmap
import platform
import sys

from afdc.runtime import trace

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_WAIT, _WAKE, _WAKE_OP = 0, 1, 5
_ALL = 0x7FFFFFFF  # wake every waiter
# FUTEX_OP(FUTEX_OP_ADD, 1, FUTEX_OP_CMP_EQ, 0): add 1 to the second word; its conditional wake
# wakes nobody here (the second word is the first, woken already, and nr_wake2 is 0)
_ADD_ONE = (1 << 28) | (1 << 12)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _syscall():
    if _SYS_FUTEX is None or not sys.platform.startswith("linux"):
        return None
    call = ctypes.CDLL(None, use_errno=True).syscall
    call.restype = ctypes.c_long
    return call


_CALL = _syscall()
AVAILABLE = _CALL is not None


class Word:
    """The 32-bit word at ``offset`` (4-byte aligned) of the shared mapping ``buffer``; a 64-bit
    counter's low half on a little-endian machine, which changes whenever the counter does."""

    def __init__(self, buffer: mmap.mmap, offset: int):
        self._word = ctypes.c_uint32.from_buffer(buffer, offset)  # keeps the mapping while it lives
        self._address = ctypes.c_void_p(ctypes.addressof(self._word))

    @trace.phase("futex.wait")
    def wait(self, seen: int, seconds: float) -> None:
        """Sleep until a wake, or ``seconds``; at once if the word is no longer ``seen`` (its low
        32 bits), whatever wrote it."""
        timeout = _Timespec(int(seconds), int(seconds % 1 * 1e9))
        _CALL(ctypes.c_long(_SYS_FUTEX), self._address, _WAIT, ctypes.c_uint32(seen & 0xFFFFFFFF),
              ctypes.byref(timeout), None, 0)  # fmt: skip

    @trace.phase("futex.wake")
    def wake(self) -> None:
        _CALL(ctypes.c_long(_SYS_FUTEX), self._address, _WAKE, _ALL, None, None, 0)

    def ring(self) -> None:
        """Add 1 to the word and wake every waiter, in one call (``FUTEX_WAKE_OP``). The kernel's
        add is atomic: processes ringing one word at once all count, where a read-modify-write
        from Python could lose one and leave its waiter asleep with a message posted."""
        _CALL(ctypes.c_long(_SYS_FUTEX), self._address, _WAKE_OP, _ALL, None, self._address, _ADD_ONE)

    @property
    def value(self) -> int:
        return self._word.value
