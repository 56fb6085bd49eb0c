"""When afdc's Triton kernels run, and how they are JIT-compiled.

Triton is optional (the ``kernels`` extra; GPU installs of torch bring it). A kernel launches on
CUDA tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` (Triton's interpreter: slow, for
tests on tiny shapes). Everywhere else each op runs its PyTorch reference, so a program that uses
afdc's ops is correct on any machine.

``TRITON_INTERPRET`` must be set before ``triton`` is imported: Triton wraps its own library
functions (``tl.sum``, ``tl.max``) for the interpreter at import. Kernel files define their
kernels as plain Python with ``from __future__ import annotations`` (Triton reads
``tl.constexpr`` from the annotation's text) and wrap them with :func:`jit` at first launch, so
importing afdc never compiles or imports anything a CPU install lacks.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the kernels extra is not installed: every op runs its reference
    triton = None
    tl = None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available() -> bool:
    """Whether Triton is installed."""
    return triton is not None


def launches(*tensors: torch.Tensor) -> bool:
    """Whether a kernel runs on these tensors (else the op runs its PyTorch reference)."""
    if triton is None or not tensors:
        return False
    devices = {t.device.type for t in tensors}
    return devices == {"cuda"} or (devices == {"cpu"} and interpreting())


# The interpreter keeps the launch grid in globals: two threads (micro-batches) launching at
# once would read each other's grid, so interpreted launches take turns. GPU launches do not.
# It also parses each kernel's source at its first launch, and on CPython 3.11 two threads
# parsing or compiling Python at once can fail ("AST constructor recursion depth mismatch",
# seen in CI: one TP rank's thread launching while another compiled its lowered program), so
# code that compiles source in such threads takes this lock too (re-entrant: it may launch).
# It is the lock Dynamo holds while it compiles a frame (Inductor's code generation included):
# a launch in one micro-batch's thread while Dynamo compiled the FFN program in another's failed
# that way too, in a CI-like run of the suite. Dynamo is imported at the lock's first use, not
# here: it costs a second of CPU, which a process that imports afdc's ops but builds no program
# (the CLI, `afdc plan`) need not pay; one that builds a straight-line program still does.
_FALLBACK_LOCK = threading.RLock()


@functools.cache
def source_lock() -> threading.RLock:
    import torch._dynamo.convert_frame

    return getattr(torch._dynamo.convert_frame, "compile_lock", None) or _FALLBACK_LOCK


class _Kernel:
    def __init__(self, fn: Callable):
        self.jitted = triton.jit(fn)

    def __getitem__(self, grid) -> Callable:
        launch = self.jitted[grid]
        if not interpreting():
            return launch

        def one_at_a_time(*args, **kwargs):
            with source_lock():
                return launch(*args, **kwargs)

        return one_at_a_time


@functools.cache
def jit(fn: Callable) -> _Kernel:
    """``triton.jit(fn)``, made once per kernel at its first launch; ``jit(fn)[grid](...)``."""
    return _Kernel(fn)


def device_function(fn: Callable) -> Callable:
    """A helper that kernels call: ``triton.jit`` for compiled kernels; in the interpreter (and
    without Triton) the plain function, which the interpreted kernel calls as Python. Decided at
    import, as Triton itself decides the interpreter (``TRITON_INTERPRET`` set before import)."""
    return fn if triton is None or interpreting() else triton.jit(fn)


def next_power_of_2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()
