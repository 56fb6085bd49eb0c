"""The same-host transport: messages through shared-memory slots, read by the rank that waits.

Each attention rank connects to each FFN rank's Unix socket (abstract namespace, so nothing is
left on disk) and proves the deployment token for the current generation. Each direction of a
link then gets a :class:`Mailbox`, created by its sender: a slot per micro-batch,
each completed by a sequence number written after the message. No socket or thread
sits on the data path: the attention rank's micro-batch thread polls its own reply slot
(:meth:`ShmTransport.receive`), the FFN server polls every slot (:meth:`ShmTransport.collect`)
and sleeps on one :class:`Bell` for all of its links, both paced by
:class:`~afdc.runtime.transport.base.Waiter`. The socket stays for the handshake, ERROR and BYE
messages, the rare message too big for a slot, and for hearing at once that a peer
died (end of stream). Mailboxes and the bell are memfds sealed against resizing, passed over
the socket (``SCM_RIGHTS``): nothing in the file system to leave behind, and no peer can shrink
a mapping under the other end (a SIGBUS there would kill its process for the peer's fault).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import fcntl
import json
import logging
import mmap
import os
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from afdc.runtime import trace, wire
from afdc.runtime.rendezvous import Rendezvous
from afdc.runtime.transport import futex
from afdc.runtime.transport.base import LEFT, Failure, Incoming, Pacing, Transport, Waiter

log = logging.getLogger("afdc.shm")

_LINE = 64  # control words sit on their own cache lines
_WORD = struct.Struct("<Q")
_PAIR = struct.Struct("<QQ")  # a slot's seq and ack, read together
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_PAYLOAD = -(-wire.HEADER_BYTES // _LINE) * _LINE  # a slot's payload starts on a cache line after its header


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("the peer closed the connection")
        got += k
    return bytes(buf)


def _send_line(sock: socket.socket, obj: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(obj).encode() + b"\n"
    sent = socket.send_fds(sock, [data], fds) if fds else 0
    sock.sendall(data[sent:])


def _read_line(sock: socket.socket, fds: list[int], limit: int = 4096, max_fds: int = 2) -> dict:
    """One JSON line of a handshake; the file descriptors that came with it are appended to
    ``fds`` (the caller closes them), at most ``max_fds``."""
    data = b""
    while not data.endswith(b"\n"):
        chunk, got, _, _ = socket.recv_fds(sock, 1, max_fds)
        fds.extend(got)
        if not chunk or len(data) > limit or len(fds) > max_fds:
            raise ConnectionError("handshake ended early, is too long or passed too many descriptors")
        data += chunk
    return json.loads(data)


def _close_all(fds: list[int]) -> None:
    while fds:
        os.close(fds.pop())


def _memfd(name: str, size: int) -> int:
    """A new shared file of ``size`` bytes, sealed against resizing, in no directory."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS | fcntl.F_SEAL_SEAL)
    except OSError:
        os.close(fd)
        raise
    return fd


def _check_sealed(fd: int, what: str) -> os.stat_result:
    """Refuse a peer's file that is not a regular file sealed against resizing, before it is mapped."""
    info = os.fstat(fd)
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:  # a file that cannot be sealed
        seals = 0
    if not stat.S_ISREG(info.st_mode) or seals & _SEALS != _SEALS:
        raise ConnectionError(f"{what} is not a shared file sealed against resizing (its owner could shrink it "
                              "under this end); the peer runs another afdc")
    return info


class _SharedFile:
    """A sealed memfd mapped by both ends: its creator keeps the descriptor until it is passed on
    (:meth:`close_fd`); the end that maps a peer's closes its copy at once (:meth:`_from_peer`)."""

    fd: int

    @staticmethod
    def _from_peer(fd: int, make: Callable[[], _Mapped]) -> _Mapped:
        """``make()``, which maps the peer's ``fd`` after checking it; the descriptor is closed
        whatever happens."""
        try:
            mapped = make()
        finally:
            os.close(fd)
        mapped.fd = -1
        return mapped

    def close_fd(self) -> None:
        """Close the descriptor once passed on (the mapping stays)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


_Mapped = TypeVar("_Mapped", bound=_SharedFile)


class Bell(_SharedFile):
    """What an FFN server sleeps on for all of its links at once: one futex word that every
    attention rank's post rings (:meth:`futex.Word.ring`, an atomic add and a wake). A futex
    sleeps on one word, and a server with a word per link could only sleep in steps: 2.4% of a
    core per idle FFN server at 2A2F. The word is in a memfd sealed against resizing, passed to
    each attention rank with the handshake (``SCM_RIGHTS``): nothing in the file system to leave
    behind, and a peer cannot shrink the mapping under the other end (SIGBUS)."""

    def __init__(self, fd: int):
        self.fd = fd  # the server's, to pass on; a ringer's is closed once mapped
        self._mm = mmap.mmap(fd, _LINE)
        self._word = futex.Word(self._mm, 0)

    @classmethod
    def create(cls) -> Bell | None:
        """The server's bell; None where there are no futexes (the server sleeps in steps)."""
        return cls(_memfd("afdc-bell", _LINE)) if futex.AVAILABLE else None

    @classmethod
    def received(cls, fd: int) -> Bell:
        """The server's bell from its handshake, refused unless it is a sealed word."""

        def make() -> Bell:
            if _check_sealed(fd, "the FFN rank's bell").st_size != _LINE:
                raise ConnectionError("the FFN rank's bell is not one shared word; the peer runs another afdc")
            return cls(fd)

        return cls._from_peer(fd, make)

    @property
    def value(self) -> int:
        return self._word.value

    @trace.phase("shm.ring_bell")
    def ring(self) -> None:
        self._word.ring()

    def wait(self, seen: int, seconds: float) -> None:
        """Sleep up to ``seconds``, less once rung past ``seen`` (at once if it already is)."""
        self._word.wait(seen, seconds)


class Mailbox(_SharedFile):
    """One direction of a link: a fixed number of message slots in a sealed memfd, mapped by both ends.

    Line 0 holds the slot count, the slot size and how many of a slot's payload bytes the file
    holds (all of them here; none where they live in device memory, :mod:`.cuda_ipc`), line 1 the
    count of messages posted so far, line 2 + k slot k's ``seq`` (messages the sender has posted
    into it) and ``ack`` (messages the receiver has taken out). A message is its
    :class:`~afdc.runtime.wire.Header` then its tensors' bytes, written into a free slot
    (``ack == seq``) before ``seq`` and that count are bumped, so a reader that sees
    ``seq != ack`` sees the whole message (stores are not reordered with stores on x86-64); a
    subclass may keep the bytes elsewhere (:meth:`_write`, :meth:`_read`). Payloads move by one
    ``memmove`` per tensor between torch's memory and the slot, control words through ``struct``:
    a round trip is mostly such fixed costs, and torch ops cost microseconds each. The writer
    wakes the futexes after every post, whether or not anyone sleeps on them: skipping the wake
    when a count of sleepers said no one did saved ~2 us of a round trip but made the 98M MoE's
    decode over shm slower in five A/B pairs out of six (0.88 against 0.95 of in-process on
    average), for reasons not found.
    """

    payloads_in_file = True

    def __init__(self, fd: int, slots: int, slot_bytes: int, create: bool = False):
        """The mailbox in ``fd`` (kept open: the creator passes it on; see :meth:`close_fd`).
        ``create``: a new one of ``slots`` slots of ``slot_bytes`` (``fd`` sized by
        :meth:`file_size`); else the peer's, which must be sealed and of that geometry (both ends
        run the same constants), checked before it is mapped: what a reader takes out of a slot
        is bounded by it."""
        in_file = self._payload_bytes_in_file(slot_bytes)
        size = self.file_size(slots, slot_bytes)
        if not create:
            _check_geometry(fd, (slots, slot_bytes, in_file), size)
        self.fd = fd
        self._mm = mmap.mmap(fd, size)
        if create:
            for i, word in enumerate((slots, slot_bytes, in_file)):
                _WORD.pack_into(self._mm, 8 * i, word)
        self.slots, self.slot_bytes, self._in_file = slots, slot_bytes, in_file
        self._body = (2 + self.slots) * _LINE
        self._address = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
        self._controls = struct.Struct("<" + f"QQ{_LINE - 16}x" * self.slots)  # every seq and ack in one read
        # a micro-batch thread sleeps on its own slot's seq: a sibling's reply must not wake it to
        # contend for the GIL (a server sleeps on its Bell, for every slot of every link)
        self._seqs = [futex.Word(self._mm, (2 + k) * _LINE) for k in range(self.slots)] if futex.AVAILABLE else []

    @classmethod
    def _payload_bytes_in_file(cls, slot_bytes: int) -> int:
        return slot_bytes if cls.payloads_in_file else 0

    @classmethod
    def file_size(cls, slots: int, slot_bytes: int) -> int:
        return (2 + slots) * _LINE + slots * (_PAYLOAD + cls._payload_bytes_in_file(slot_bytes))

    @classmethod
    def create(cls, slots: int, slot_bytes: int, device: torch.device) -> Mailbox:
        """A new mailbox for its sender on ``device`` (host memory here: the device is what a
        subclass keeps payloads on)."""
        return cls(_memfd("afdc-mailbox", cls.file_size(slots, slot_bytes)), slots, slot_bytes, create=True)

    def describe(self) -> dict:
        """What the peer needs besides :attr:`fd` to open this mailbox (sent in the handshake)."""
        return {}

    @classmethod
    def open(cls, description: dict, fd: int, device: torch.device, slots: int, slot_bytes: int) -> Mailbox:
        """The peer's mailbox from its :meth:`describe` and descriptor (closed here, whatever
        happens), of the geometry agreed; ``device`` is where taken tensors go."""
        return cls._from_peer(fd, lambda: cls(fd, slots, slot_bytes))

    @property
    def posted(self) -> int:
        return _WORD.unpack_from(self._mm, _LINE)[0]

    def _seq(self, k: int) -> int:
        return _WORD.unpack_from(self._mm, (2 + k) * _LINE)[0]

    def _ack(self, k: int) -> int:
        return _WORD.unpack_from(self._mm, (2 + k) * _LINE + 8)[0]

    def _control(self, k: int) -> tuple[int, int]:
        """Slot ``k``'s seq and ack in one read (a round trip reads them a few times a side)."""
        return _PAIR.unpack_from(self._mm, (2 + k) * _LINE)

    def _start(self, k: int) -> int:
        return self._body + k * (_PAYLOAD + self._in_file)

    def fits(self, payload_bytes: int) -> bool:
        return payload_bytes <= self.slot_bytes

    def free(self, k: int) -> bool:
        """Sender: the receiver has taken slot ``k``'s last message."""
        seq, ack = self._control(k)
        return seq == ack

    def ready(self, k: int) -> bool:
        """Receiver: slot ``k`` holds a message not yet taken."""
        seq, ack = self._control(k)
        return seq != ack

    def pending(self) -> list[int]:
        """Receiver: the slots that hold a message not yet taken."""
        words = self._controls.unpack_from(self._mm, 2 * _LINE)
        return [k for k in range(self.slots) if words[2 * k] != words[2 * k + 1]]

    @trace.phase("shm.put")
    def put(self, k: int, header: wire.Header, tensors: list[torch.Tensor], pacing: Pacing, timeout: float,
            receiver: str, wake: bool = True):
        """Sender: post a message (``tensors`` contiguous, in host memory) into slot ``k`` once the
        receiver has taken the last one; ``wake``: wake a reader asleep on the slot (a sender to
        a server rings the server's :class:`Bell` instead)."""
        seq, ack = self._control(k)
        if ack != seq:
            pause, deadline = Waiter(pacing).pauses(), time.monotonic() + timeout
            while self._ack(k) != seq:
                if time.monotonic() > deadline:
                    raise ConnectionError(f"{receiver} has not taken its last message for slot {k}")
                pause()
        header.encode_into(self._mm, self._start(k))
        self._write(k, tensors)
        _WORD.pack_into(self._mm, (2 + k) * _LINE, seq + 1)
        _WORD.pack_into(self._mm, _LINE, self.posted + 1)
        if wake and self._seqs:
            self._seqs[k].wake()

    def wait_ready(self, k: int, seconds: float) -> None:
        """Receiver: sleep up to ``seconds``, less once slot ``k`` holds a message (at once if it does)."""
        seq, ack = self._control(k)
        if seq != ack:
            return
        if not self._seqs:
            time.sleep(seconds)
        else:
            self._seqs[k].wait(seq, seconds)

    def wake_readers(self) -> None:
        """Wake whoever sleeps on this mailbox's slots without posting: the reader has something
        to look at that came another way (a message over the socket, the link's end)."""
        for word in self._seqs:
            word.wake()

    @trace.phase("shm.take")
    def take(self, k: int) -> tuple[wire.Header, list[torch.Tensor]]:
        """Receiver: the message in slot ``k``, its tensors copied out (into torch's own aligned
        memory: the programs compute on it, and a matmul over a tensor backed by a mapping ran
        several times slower), and the slot freed."""
        seq, start = self._seq(k), self._start(k)  # the sender posts nothing more here until it is acked
        header = wire.Header.decode_from(self._mm, start)
        if header.payload_bytes > self.slot_bytes:
            raise wire.WireError(f"slot {k} claims {header.payload_bytes} bytes, more than its {self.slot_bytes}")
        tensors = self._read(k, header.tensors)
        _WORD.pack_into(self._mm, (2 + k) * _LINE + 8, seq)
        return header, tensors

    # -- where a slot's payload bytes live: in the file, right after its header -------------------

    @trace.phase("shm.copy_in")
    def _write(self, k: int, tensors: list[torch.Tensor]) -> None:
        """Copy ``tensors`` into slot ``k``; done when this returns (the slot is posted next)."""
        at = self._address + self._start(k) + _PAYLOAD
        for t in tensors:
            n = t.nbytes
            ctypes.memmove(at, t.data_ptr(), n)
            at += n

    @trace.phase("shm.copy_out")
    def _read(self, k: int, specs: tuple[wire.TensorSpec, ...]) -> list[torch.Tensor]:
        """Copies of slot ``k``'s tensors; done when this returns (the slot is freed next)."""
        tensors, at = [], self._address + self._start(k) + _PAYLOAD
        for spec in specs:
            t = torch.empty(spec.shape, dtype=spec.dtype)
            n = t.nbytes
            if n:
                ctypes.memmove(t.data_ptr(), at, n)
            tensors.append(t)
            at += n
        return tensors


def _check_geometry(fd: int, words: tuple[int, int, int], size: int) -> None:
    """Refuse a peer's mailbox that is not sealed or not of the agreed geometry (``words``: slot
    count, slot bytes, payload bytes per slot in the file), before it is mapped."""
    info = _check_sealed(fd, "the peer's mailbox")
    head = os.pread(fd, 3 * _WORD.size, 0)
    if len(head) < 3 * _WORD.size:
        raise ConnectionError("the peer's mailbox is not a mailbox")
    got = struct.unpack("<QQQ", head)
    if bool(got[2]) != bool(words[2]):
        raise ConnectionError(f"the peer's mailbox holds payloads {'in' if got[2] else 'out of'} the file; the "
                              "peer runs another connector (every rank of a deployment must use the same one)")
    if got != words or info.st_size != size:
        raise ConnectionError(
            f"the peer's mailbox holds {got[0]} slots of {got[1]} bytes in {info.st_size} bytes, not the "
            f"{words[0]} of {words[1]} ({size} bytes) agreed: the peer runs another afdc (run the same on every rank)"
        )


_SLOTTED = (wire.Kind.DATA, wire.Kind.RESULT, wire.Kind.STEP)
_EMPTY = torch.empty(0, dtype=torch.uint8)
_CHUNK = 1 << 20  # a payload over the socket is read in pieces: memory grows with what arrived, not what was claimed


def _slot(box: Mailbox, micro_batch: int) -> int:
    """Micro-batch ``micro_batch``'s slot; the last slot carries step plans."""
    return micro_batch % (box.slots - 1)


class _Link:
    """A connected peer: the socket (handshake, control messages, messages too big for a slot, and
    the peer's death as end of stream), the mailbox this end writes and the one it reads."""

    def __init__(self, sock: socket.socket, outbound: Mailbox, inbound: Mailbox, bell: Bell | None = None):
        self.sock, self.outbound, self.inbound = sock, outbound, inbound
        self.bell = bell  # an attention rank's: the FFN rank's, rung after each data message
        self.lock = threading.Lock()  # one writer at a time, on the socket and per slot
        self.reading = threading.Lock()  # one reader per inbound slot (micro-batches may share one)
        self.seen = 0  # the inbound count of posts when its slots were last scanned
        # a server's last reply on this link, whose answer (the peer's next message) it waits for:
        # (its spin budget's key: the link and the layer answered, when it was posted)
        self.replied: tuple[tuple[int, int], float] | None = None
        # a server's replies whose slot the peer has not freed yet: (slot, header, tensors, since)
        self.backlog: collections.deque[tuple[int, wire.Header, list[torch.Tensor], float]] = collections.deque()
        self.dropped = False  # this end ended the link (its failure is said once)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class ShmTransport(Transport):
    mailbox: type[Mailbox] = Mailbox
    slots = 8  # data slots per link and direction (micro-batch m uses slot m % slots), and one for step plans
    slot_bytes = 8 << 20  # a bigger message goes over the socket
    polled = True
    wakes = futex.AVAILABLE

    def _open(self) -> None:
        self._links: dict[int, _Link] = {}
        self._waiter = Waiter(self.pacing)  # the FFN server's, for collect
        self._closed = False
        self._lock = threading.Lock()
        self._bell = Bell.create() if self.role == "ffn" else None  # what the server sleeps on
        self._bell_seen = 0  # its value when the server last scanned its links
        if self.role == "ffn":
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._listener.bind(self.address(self.rendezvous, self.slot))
            self._listener.listen()
            threading.Thread(target=self._accept, daemon=True, name="afdc-shm-accept").start()
        else:
            for peer in self.layout.peers(self.role):
                self._connect(peer, self.group.members[peer].address)

    @staticmethod
    def address(rendezvous: Rendezvous, slot: int) -> str:
        return f"\0afdc-{rendezvous.deployment.hex()}-{slot}-{os.getpid()}"

    def _new_mailbox(self) -> Mailbox:
        return self.mailbox.create(self.slots + 1, self.slot_bytes, self.device)

    def _staged(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as its mailbox copies it: contiguous, in host memory."""
        return t if t.is_cpu and t.is_contiguous() else t.detach().contiguous().cpu()

    def _connect(self, peer: int, address: str) -> None:
        deadline = time.monotonic() + self.timeout
        while True:  # the peer creates its listener right after the group forms
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(address)
                break
            except OSError:
                sock.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        outbound = self._new_mailbox()
        fds: list[int] = []
        try:
            gen = self.group.generation
            proof = self.rendezvous.proof(gen, self.slot)
            sock.settimeout(self.timeout)
            hello = {"slot": self.slot, "generation": gen, "proof": proof, "mailbox": outbound.describe()}
            _send_line(sock, hello, [outbound.fd])
            reply = _read_line(sock, fds)
            if "error" in reply:
                raise ConnectionError(f"refused by the FFN rank: {reply['error']}")
            if len(fds) != 1 + bool(reply.get("bell")):
                raise ConnectionError(f"the FFN rank passed {len(fds)} descriptors for its mailbox and bell")
            bell = Bell.received(fds.pop()) if reply.get("bell") else None
            inbound = self._peer_mailbox(reply["mailbox"], fds)
        finally:
            outbound.close_fd()
            _close_all(fds)
        sock.settimeout(None)
        self._start(peer, _Link(sock, outbound, inbound, bell))

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._handshake, args=(sock,), daemon=True).start()

    def _handshake(self, sock: socket.socket) -> None:
        """Verify a connecting attention rank; a stranger is refused and logged, nothing else changes."""
        outbound = None
        fds: list[int] = []
        try:
            sock.settimeout(self.timeout)
            hello = _read_line(sock, fds, max_fds=1)
            slot, gen = int(hello["slot"]), int(hello["generation"])
            reason = ""
            if slot not in self.layout.peers(self.role):
                reason = f"slot {slot} is not an attention rank of this plan"
            elif gen != self.group.generation:
                reason = f"generation {gen} is not the current one ({self.group.generation})"
            elif hello.get("proof") != self.rendezvous.proof(gen, slot):
                reason = "wrong deployment token or another artifact"
            if reason:
                log.warning("refused a connection: %s", reason)
                _send_line(sock, {"error": reason})
                sock.close()
                return
            inbound = self._peer_mailbox(hello["mailbox"], fds)
            outbound = self._new_mailbox()
            bell = [self._bell.fd] if self._bell is not None else []
            _send_line(sock, {"mailbox": outbound.describe(), "bell": bool(bell)}, [outbound.fd, *bell])
            sock.settimeout(None)
            self._start(slot, _Link(sock, outbound, inbound))
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as err:  # Runtime: a device buffer not mapped
            log.warning("refused a connection: malformed handshake (%s)", err)
            sock.close()
        finally:
            if outbound is not None:
                outbound.close_fd()
            _close_all(fds)

    def _peer_mailbox(self, description: dict, fds: list[int]) -> Mailbox:
        """The peer's mailbox of a handshake: the one descriptor it passed (taken from ``fds``), a
        sealed file of the agreed geometry."""
        if len(fds) != 1:
            raise ConnectionError(f"the peer passed {len(fds)} descriptors for its mailbox, not 1")
        return self.mailbox.open(description, fds.pop(), self.device, self.slots + 1, self.slot_bytes)

    def _start(self, peer: int, link: _Link) -> None:
        # a peer that stops reading its socket stalls a send for at most the timeout, then loses its link
        link.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(self.timeout), 0))
        with self._lock:
            old = self._links.pop(peer, None)
            if old is not None:  # the peer connected again: its old link ends without a failure
                old.dropped = True
                old.close()
            self._links[peer] = link
        threading.Thread(target=self._receive, args=(peer, link), daemon=True, name=f"afdc-shm-{peer}").start()

    @trace.phase("shm.send")
    def send(self, peer: int, header: wire.Header, tensors: list[torch.Tensor]) -> None:
        """DATA and RESULT messages go into the micro-batch's slot, STEP plans into the last one;
        the rest (ERROR, BYE) and what does not fit a slot go over the socket, header then payload."""
        link = self._links.get(peer)
        if link is None:
            raise ConnectionError(f"no link to slot {peer}")
        self._check_outgoing(header)
        box = link.outbound
        if header.kind in _SLOTTED and box.fits(header.payload_bytes):
            slot = _slot(box, header.micro_batch) if header.kind != wire.Kind.STEP else box.slots - 1
            staged = [self._staged(t) for t in tensors]
            with link.lock:
                if self.role == "ffn":  # a server never waits for one peer to free a slot: its others wait on it
                    if not link.backlog and box.free(slot):
                        box.put(slot, header, staged, self.pacing, self.timeout, f"slot {peer}")
                    else:
                        link.backlog.append((slot, header, staged, time.monotonic()))
                        self._flush(peer, link)
                    link.replied = ((peer, header.layer), time.monotonic())
                    return
                box.put(slot, header, staged, self.pacing, self.timeout, f"slot {peer}", wake=False)
            # a step plan wakes no one: the server reads it with the step's first data message, and
            # a wake-up per step that finds nothing to run cost a context switch on each side
            if link.bell is not None and header.kind != wire.Kind.STEP:
                link.bell.ring()
            return
        head = header.encode()
        with link.lock:
            try:
                link.sock.sendall(head)
                link.sock.sendall(memoryview(wire.pack(tensors).cpu().numpy()))
            except OSError as err:  # a message cut short: nothing more on this stream can be parsed
                self._drop(peer, link, f"could not send to it ({err})")
                raise

    def _flush(self, peer: int, link: _Link) -> None:
        """Post a server's replies that wait for their slots, in order, as far as the peer freed
        them (``link.lock`` held); a peer that leaves them waiting ``timeout`` loses its link."""
        box = link.outbound
        while link.backlog and box.free(link.backlog[0][0]):
            slot, head, staged, _ = link.backlog.popleft()
            box.put(slot, head, staged, self.pacing, self.timeout, f"slot {peer}")
        if link.backlog and (time.monotonic() - link.backlog[0][3] > self.timeout or len(link.backlog) > self.slots):
            link.backlog.clear()
            self._drop(peer, link, f"it has not taken its replies for {self.timeout:g} s")

    @trace.phase("shm.receive")
    def receive(self, peers: list[int], micro_batch: int) -> list[Incoming]:
        arrived = []
        for peer in peers:
            link = self._links.get(peer)
            slot = _slot(link.inbound, micro_batch) if link is not None else 0
            if link is None or not link.inbound.ready(slot) or not link.reading.acquire(blocking=False):
                continue
            try:
                taken = self._take(peer, link, slot)
            finally:
                link.reading.release()
            if taken is not None:
                arrived.append(taken)
        return arrived

    def block(self, peers: list[int], micro_batch: int, seconds: float) -> None:
        link = self._links.get(peers[0]) if peers else None
        if link is None:
            time.sleep(seconds)
            return
        link.inbound.wait_ready(_slot(link.inbound, micro_batch), seconds)

    def _block_any(self, seconds: float) -> None:
        """The server's sleep between two scans: on its bell, as rung when it last scanned (a
        post since then has rung it past that: no sleep)."""
        if self._bell is None:
            time.sleep(seconds)
        else:
            self._bell.wait(self._bell_seen, seconds)

    def _wake_reader(self, link: _Link) -> None:
        """Wake this end's reader of ``link`` for what came another way (a socket message, the
        link's end): the server on its bell, a micro-batch thread on its slot."""
        if self._bell is not None:
            self._bell.ring()
        else:
            link.inbound.wake_readers()

    @trace.phase("shm.collect")
    def collect(self, wait: float) -> list[Incoming | Failure]:
        start = time.monotonic()
        deadline = start + wait
        pause = None
        while True:
            if self._bell is not None:  # read before the scan: a post after it has rung it past this
                self._bell_seen = self._bell.value
            items = self._scan()
            if items:
                self._waiter.waited(time.monotonic() - start)
                return items
            now = time.monotonic()
            if now >= deadline:
                return items
            if pause is None:  # made once a scan found nothing: a busy server's scan mostly finds something
                # a reply held back for its slot goes out when the peer frees the slot, which wakes
                # no one: then the wait looks again within max_sleep rather than blocking
                wakes = self._bell is not None and not any(link.backlog for link in list(self._links.values()))
                pause = self._waiter.pauses(
                    block=self._block_any, wakes=wakes, until=deadline, spin_for=self._spin_left(now)
                )
            pause()

    def _spin_left(self, now: float) -> float:
        """How long the server may still poll: as long as any link's answer to its last reply is
        likely soon (its learned budget, counted from the reply)."""
        replied = [link.replied for link in list(self._links.values()) if link.replied is not None]
        return max((self._waiter.spin_left(key, since, now) for key, since in replied), default=0.0)

    @trace.phase("shm.scan")
    def _scan(self) -> list[Incoming | Failure]:
        """What came on every link since the last scan; each link's held-back replies are posted
        first, as far as the peer freed their slots."""
        items: list[Incoming | Failure] = []
        for peer, link in list(self._links.items()):
            if link.backlog:
                with link.lock:
                    self._flush(peer, link)
            box = link.inbound
            posted = box.posted  # read before the scan: a message posted after it rings again
            if posted == link.seen:
                continue
            link.seen = posted
            pending = box.pending()
            # the peer's next data message answers the last reply (a step plan comes ahead of the
            # step's first): how long it took is learned
            if link.replied is not None and any(k != box.slots - 1 for k in pending):
                key, since = link.replied
                self._waiter.answered(key, time.monotonic() - since)
                link.replied = None
            if len(pending) > 1:  # a step plan first: the data messages that came with it are gathered by it
                pending.sort(key=lambda k: k != box.slots - 1)
            for slot in pending:
                taken = self._take(peer, link, slot)
                if taken is None:
                    break
                items.append(taken)
        if not self.inbox.empty():  # the sockets' messages, and the failures of links (dropped ones too)
            items.extend(self._drain())
        return items

    def _take(self, peer: int, link: _Link, slot: int) -> Incoming | None:
        """The message in ``slot`` of ``peer``'s link, on this rank's device; None where it cannot be
        taken (malformed, too big for its slot, another sender's): the link is dropped then."""
        try:
            header, tensors = link.inbound.take(slot)
            refusal = self._refusal(peer, header)
            if refusal:
                raise wire.WireError(refusal)
        except (wire.WireError, RuntimeError, ValueError) as err:  # Runtime: shapes torch cannot allocate
            self._drop(peer, link, f"a malformed message in slot {slot}: {err}")
            return None
        if self.device.type != "cpu":
            tensors = [t.to(self.device) for t in tensors]
        return Incoming(header, tensors)

    def _drop(self, peer: int, link: _Link, reason: str) -> None:
        """End ``peer``'s link from this end, saying why once (the peer hears the socket close)."""
        with self._lock:
            if link.dropped:
                return
            link.dropped = True
            if self._links.get(peer) is link:
                del self._links[peer]
        if not self._closed:
            self.deliver(Failure(peer, reason))
            self._wake_reader(link)
        link.close()

    def _receive(self, peer: int, link: _Link) -> None:
        try:
            while True:
                header = wire.Header.decode(_read_exact(link.sock, wire.HEADER_BYTES))
                if header.kind == wire.Kind.BYE:
                    raise ConnectionError(LEFT)
                refusal = self._refusal(peer, header)
                if refusal:
                    raise wire.WireError(refusal)
                payload = bytearray()
                while len(payload) < header.payload_bytes:
                    payload += _read_exact(link.sock, min(_CHUNK, header.payload_bytes - len(payload)))
                self._arrived(header, torch.frombuffer(payload, dtype=torch.uint8) if payload else _EMPTY)
                self._wake_reader(link)  # a reader blocked on the slots must look at what came here
        except (OSError, wire.WireError, RuntimeError, ValueError) as err:  # Runtime, Value: tensors torch refuses
            self._drop(peer, link, str(err))

    def _release(self) -> None:
        self._closed = True
        if self.role == "ffn":
            with contextlib.suppress(OSError):  # wakes the accept thread; close alone leaves it listening
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()
        if self._bell is not None:
            self._bell.close_fd()
