"""One export attempt's capture state, and the context through which afdc's hooks reach it.

The state is a fresh :class:`CaptureSession` per ``torch.export`` attempt (slots numbered from 0
each time). What the attempt builds is handed it: the stand-in cache holds it, and a stateful
mixer's op records its call site in the session of the cache it was called with. transformers
calls afdc's attention and mask functions by name, so they cannot be handed it; they read it from
:func:`current`, a context variable: per thread, and a capture started inside another (a nested
:func:`tracing`) restores the outer one on exit.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

from afdc.mixer_site import MixerSite


@dataclass
class CaptureSession:
    """What one export attempt has traced so far."""

    attention_slots: Iterator[int] = field(default_factory=itertools.count)  # each attention call's KV slot
    key_slots: Iterator[int] = field(default_factory=itertools.count)  # sparse-attention indexers' key caches
    mixer_sites: list[MixerSite] = field(default_factory=list)  # in call order; a site's slot is its index
    # mask tensor id -> (mask, the sliding-window or chunk size it was built with); holding the
    # mask keeps its id from being reused within the attempt
    windows: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)

    def note_window(self, mask: torch.Tensor, size: int) -> None:
        self.windows[id(mask)] = (mask, size)

    def window(self, mask: torch.Tensor | None) -> int:
        """The window ``mask`` was built with (0: none recorded)."""
        return self.windows.get(id(mask), (None, 0))[1]


_CURRENT: ContextVar[CaptureSession | None] = ContextVar("afdc_capture_session", default=None)


def current() -> CaptureSession | None:
    """The export attempt under way in this context (None: no capture, the hooks run as plain attention)."""
    return _CURRENT.get()


@contextlib.contextmanager
def tracing(session: CaptureSession) -> Iterator[CaptureSession]:
    """``session`` is the current one while the block runs."""
    token = _CURRENT.set(session)
    try:
        yield session
    finally:
        _CURRENT.reset(token)
