"""The same-host transport: messages through shared-memory slots, read by the rank that waits.

Each attention rank connects to each FFN rank's Unix socket (abstract namespace, so nothing is
left on disk) and proves the deployment token for the current generation. Each direction of a
link then gets a :class:`Mailbox` in ``/dev/shm``, created by its sender: a slot per micro-batch,
each completed by a sequence number written after the message. No socket, thread or wake-up
sits on the data path: the attention rank's micro-batch thread polls its own reply slot
(:meth:`ShmTransport.receive`), the FFN server polls every slot (:meth:`ShmTransport.collect`),
both paced by :class:`~afdc.runtime.transport.base.Waiter`. The socket stays for the handshake,
ERROR and BYE messages, the rare message too big for a slot, and for hearing at once that a peer
died (end of stream). Mailbox files are unlinked as soon as both ends have mapped them.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import mmap
import os
import socket
import struct
import threading
import time
import uuid
from pathlib import Path

import torch

from afdc.runtime import wire
from afdc.runtime.rendezvous import Rendezvous
from afdc.runtime.transport import futex
from afdc.runtime.transport.base import LEFT, Failure, Incoming, Pacing, Transport, Waiter

log = logging.getLogger("afdc.shm")

_LINE = 64  # control words sit on their own cache lines
_WORD = struct.Struct("<Q")
_SHM_DIR = Path("/dev/shm")
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


def _send_line(sock: socket.socket, obj: dict) -> None:
    sock.sendall(json.dumps(obj).encode() + b"\n")


def _read_line(sock: socket.socket, limit: int = 4096) -> dict:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(1)
        if not chunk or len(data) > limit:
            raise ConnectionError("handshake ended early or is too long")
        data += chunk
    return json.loads(data)


class Mailbox:
    """One direction of a link: a fixed number of message slots in ``/dev/shm``, mapped by both ends.

    Line 0 holds the slot count, the slot size and how many of a slot's payload bytes the file
    holds (all of them here; none where they live in device memory, :mod:`.cuda_ipc`), line 1 the
    doorbell (messages posted so far), line 2 + k slot k's ``seq`` (messages the sender has posted
    into it) and ``ack`` (messages the receiver has taken out). A message is its
    :class:`~afdc.runtime.wire.Header` then its tensors' bytes, written into a free slot
    (``ack == seq``) before ``seq`` and the doorbell are bumped, so a reader that sees
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

    def __init__(self, path: Path, slots: int = 0, slot_bytes: int = 0, create: bool = False):
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                in_file = slot_bytes if self.payloads_in_file else 0
                os.ftruncate(fd, (2 + slots) * _LINE + slots * (_PAYLOAD + in_file))
            self._mm = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        if create:
            _WORD.pack_into(self._mm, 0, slots)
            _WORD.pack_into(self._mm, 8, slot_bytes)
            _WORD.pack_into(self._mm, 16, in_file)
        self.path = path
        self.slots, self.slot_bytes, self._in_file = (_WORD.unpack_from(self._mm, 8 * i)[0] for i in range(3))
        if self._in_file != (self.slot_bytes if self.payloads_in_file else 0):
            raise ConnectionError(f"{path} holds payloads {'in' if self._in_file else 'out of'} the file; the peer "
                                  "runs another connector (every rank of a deployment must use the same one)")
        self._body = (2 + self.slots) * _LINE
        self._view = memoryview(self._mm)
        self._address = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
        self._controls = struct.Struct("<" + f"QQ{_LINE - 16}x" * self.slots)  # every seq and ack in one read
        # what readers sleep on: the doorbell (a server, for any slot) and each slot's seq (a
        # micro-batch thread, for its own: a sibling's reply must not wake it to contend for the GIL)
        words = [futex.Word(self._mm, line * _LINE) for line in range(1, 2 + self.slots)] if futex.AVAILABLE else []
        self._doorbell, self._seqs = (words[0], words[1:]) if words else (None, [])

    @classmethod
    def create(cls, path: Path, slots: int, slot_bytes: int, device: torch.device) -> Mailbox:
        """A new mailbox at ``path`` for its sender on ``device`` (host memory here: the device is
        what a subclass keeps payloads on)."""
        return cls(path, slots, slot_bytes, create=True)

    def describe(self) -> dict:
        """What the peer needs to open this mailbox (sent in the handshake)."""
        return {"path": str(self.path)}

    @classmethod
    def open(cls, description: dict, device: torch.device) -> Mailbox:
        """The peer's mailbox from its :meth:`describe`; ``device`` is where taken tensors go."""
        return cls(Path(description["path"]))

    @property
    def posted(self) -> int:
        return _WORD.unpack_from(self._mm, _LINE)[0]

    def _seq(self, k: int) -> int:
        return _WORD.unpack_from(self._mm, (2 + k) * _LINE)[0]

    def _ack(self, k: int) -> int:
        return _WORD.unpack_from(self._mm, (2 + k) * _LINE + 8)[0]

    def _start(self, k: int) -> int:
        return self._body + k * (_PAYLOAD + self._in_file)

    def fits(self, payload_bytes: int) -> bool:
        return payload_bytes <= self.slot_bytes

    def ready(self, k: int) -> bool:
        """Receiver: slot ``k`` holds a message not yet taken."""
        return self._seq(k) != self._ack(k)

    def pending(self) -> list[int]:
        """Receiver: the slots that hold a message not yet taken."""
        words = self._controls.unpack_from(self._mm, 2 * _LINE)
        return [k for k in range(self.slots) if words[2 * k] != words[2 * k + 1]]

    def put(self, k: int, header: bytes, tensors: list[torch.Tensor], pacing: Pacing, timeout: float, receiver: str):
        """Sender: post a message (``tensors`` contiguous, in host memory) into slot ``k`` once the
        receiver has taken the last one."""
        seq = self._seq(k)
        if self._ack(k) != seq:
            pause, deadline = Waiter(pacing).pauses(), time.monotonic() + timeout
            while self._ack(k) != seq:
                if time.monotonic() > deadline:
                    raise ConnectionError(f"{receiver} has not taken its last message for slot {k}")
                pause()
        start = self._start(k)
        self._view[start : start + len(header)] = header
        self._write(k, tensors)
        _WORD.pack_into(self._mm, (2 + k) * _LINE, seq + 1)
        _WORD.pack_into(self._mm, _LINE, self.posted + 1)
        if self._doorbell is not None:
            self._seqs[k].wake()
            self._doorbell.wake()

    def wait_posted(self, seen: int, seconds: float) -> None:
        """Receiver: sleep up to ``seconds``, less once the doorbell is past ``seen`` (at once if
        it already is)."""
        if self._doorbell is None:
            time.sleep(seconds)
        elif self.posted == seen:
            self._doorbell.wait(seen, seconds)

    def wait_ready(self, k: int, seconds: float) -> None:
        """Receiver: sleep up to ``seconds``, less once slot ``k`` holds a message (at once if it does)."""
        seq = self._seq(k)
        if seq != self._ack(k):
            return
        if self._doorbell is None:
            time.sleep(seconds)
        else:
            self._seqs[k].wait(seq, seconds)

    def take(self, k: int) -> tuple[wire.Header, list[torch.Tensor]]:
        """Receiver: the message in slot ``k``, its tensors copied out (into torch's own aligned
        memory: the programs compute on it, and a matmul over a tensor backed by a mapping ran
        several times slower), and the slot freed."""
        start = self._start(k)
        header = wire.Header.decode(self._mm[start : start + wire.HEADER_BYTES])
        if header.payload_bytes > self.slot_bytes:
            raise wire.WireError(f"slot {k} claims {header.payload_bytes} bytes, more than its {self.slot_bytes}")
        tensors = self._read(k, header.tensors)
        _WORD.pack_into(self._mm, (2 + k) * _LINE + 8, self._seq(k))
        return header, tensors

    # -- where a slot's payload bytes live: in the file, right after its header -------------------

    def _write(self, k: int, tensors: list[torch.Tensor]) -> None:
        """Copy ``tensors`` into slot ``k``; done when this returns (the slot is posted next)."""
        at = self._address + self._start(k) + _PAYLOAD
        for t in tensors:
            n = t.numel() * t.element_size()
            ctypes.memmove(at, t.data_ptr(), n)
            at += n

    def _read(self, k: int, specs: tuple[wire.TensorSpec, ...]) -> list[torch.Tensor]:
        """Copies of slot ``k``'s tensors; done when this returns (the slot is freed next)."""
        tensors, at = [], self._address + self._start(k) + _PAYLOAD
        for spec in specs:
            t = torch.empty(spec.shape, dtype=spec.dtype)
            n = spec.nbytes
            if n:
                ctypes.memmove(t.data_ptr(), at, n)
            tensors.append(t)
            at += n
        return tensors


_SLOTTED = (wire.Kind.DATA, wire.Kind.RESULT, wire.Kind.STEP)


def _slot(box: Mailbox, micro_batch: int) -> int:
    """Micro-batch ``micro_batch``'s slot; the last slot carries step plans."""
    return micro_batch % (box.slots - 1)


class _Link:
    """A connected peer: the socket (handshake, control messages, messages too big for a slot, and
    the peer's death as end of stream), the mailbox this end writes and the one it reads."""

    def __init__(self, sock: socket.socket, outbound: Mailbox, inbound: Mailbox):
        self.sock, self.outbound, self.inbound = sock, outbound, inbound
        self.lock = threading.Lock()  # one writer at a time, on the socket and per slot
        self.reading = threading.Lock()  # one reader per inbound slot (micro-batches may share one)
        self.seen = 0  # the inbound doorbell when its slots were last scanned

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class ShmTransport(Transport):
    mailbox: type[Mailbox] = Mailbox
    slots = 8  # data slots per link and direction (micro-batch m uses slot m % slots), and one for step plans
    slot_bytes = 8 << 20  # a bigger message goes over the socket
    polled = True

    def _open(self) -> None:
        self._links: dict[int, _Link] = {}
        self._waiter = Waiter(self.pacing)  # the FFN server's, for collect
        self._closed = False
        self._lock = threading.Lock()
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
        path = _SHM_DIR / f"afdc-{uuid.uuid4().hex}"
        return self.mailbox.create(path, self.slots + 1, self.slot_bytes, self.device)

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
        try:
            gen = self.group.generation
            proof = self.rendezvous.proof(gen, self.slot)
            sock.settimeout(self.timeout)
            _send_line(sock, {"slot": self.slot, "generation": gen, "proof": proof, "mailbox": outbound.describe()})
            reply = _read_line(sock)
            if "error" in reply:
                raise ConnectionError(f"refused by the FFN rank: {reply['error']}")
            inbound = self.mailbox.open(reply["mailbox"], self.device)
            _send_line(sock, {"mapped": True})
        finally:
            outbound.path.unlink(missing_ok=True)
        sock.settimeout(None)
        self._start(peer, _Link(sock, outbound, inbound))

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
        try:
            sock.settimeout(self.timeout)
            hello = _read_line(sock)
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
            inbound = self.mailbox.open(hello["mailbox"], self.device)
            outbound = self._new_mailbox()
            _send_line(sock, {"mailbox": outbound.describe()})
            _read_line(sock)  # the peer mapped our mailbox: it can go from the file system
            sock.settimeout(None)
            self._start(slot, _Link(sock, outbound, inbound))
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as err:  # Runtime: a device buffer not mapped
            log.warning("refused a connection: malformed handshake (%s)", err)
            sock.close()
        finally:
            if outbound is not None:
                outbound.path.unlink(missing_ok=True)

    def _start(self, peer: int, link: _Link) -> None:
        with self._lock:
            old = self._links.pop(peer, None)
            if old is not None:
                old.close()
            self._links[peer] = link
        threading.Thread(target=self._receive, args=(peer, link), daemon=True, name=f"afdc-shm-{peer}").start()

    def send(self, peer: int, header: wire.Header, tensors: list[torch.Tensor]) -> None:
        """DATA and RESULT messages go into the micro-batch's slot, STEP plans into the last one;
        the rest (ERROR, BYE) and what does not fit a slot go over the socket, header then payload."""
        link = self._links.get(peer)
        if link is None:
            raise ConnectionError(f"no link to slot {peer}")
        head = header.encode()
        with link.lock:
            box = link.outbound
            if header.kind in _SLOTTED and box.fits(header.payload_bytes):
                slot = _slot(box, header.micro_batch) if header.kind != wire.Kind.STEP else box.slots - 1
                box.put(slot, head, [self._staged(t) for t in tensors], self.pacing, self.timeout, f"slot {peer}")
            else:
                link.sock.sendall(head)
                link.sock.sendall(memoryview(wire.pack(tensors).cpu().numpy()))

    def receive(self, peers: list[int], micro_batch: int) -> list[Incoming]:
        arrived = []
        for peer in peers:
            link = self._links.get(peer)
            slot = _slot(link.inbound, micro_batch) if link is not None else 0
            if link is None or not link.inbound.ready(slot) or not link.reading.acquire(blocking=False):
                continue
            try:
                arrived.append(self._taken(*link.inbound.take(slot)))
            finally:
                link.reading.release()
        return arrived

    def block(self, peers: list[int], micro_batch: int, seconds: float) -> None:
        link = self._links.get(peers[0]) if peers else None
        if link is None:
            time.sleep(seconds)
            return
        link.inbound.wait_ready(_slot(link.inbound, micro_batch), seconds)

    def _block_any(self, seconds: float) -> None:
        """The server's sleep between two scans: on the doorbell of its one link (several links
        have several doorbells, and a futex sleeps on one word: then a plain sleep)."""
        links = list(self._links.values())
        if len(links) == 1:
            links[0].inbound.wait_posted(links[0].seen, seconds)
        else:
            time.sleep(seconds)

    def collect(self, wait: float) -> list[Incoming | Failure]:
        start = time.monotonic()
        deadline = start + wait
        pause = self._waiter.pauses(block=self._block_any)
        while True:
            items: list[Incoming | Failure] = self._drain() if not self.inbox.empty() else []
            for link in list(self._links.values()):
                box = link.inbound
                posted = box.posted  # read before the scan: a message posted after it rings again
                if posted == link.seen:
                    continue
                link.seen = posted
                items.extend(self._taken(*box.take(slot)) for slot in box.pending())
            if items:
                self._waiter.waited(time.monotonic() - start)
                return items
            if time.monotonic() >= deadline:
                return items
            pause()

    def _taken(self, header: wire.Header, tensors: list[torch.Tensor]) -> Incoming:
        """A message taken out of a slot, on this rank's device."""
        if self.device.type != "cpu":
            tensors = [t.to(self.device) for t in tensors]
        return Incoming(header, tensors)

    def _receive(self, peer: int, link: _Link) -> None:
        try:
            while True:
                header = wire.Header.decode(_read_exact(link.sock, wire.HEADER_BYTES))
                if header.kind == wire.Kind.BYE:
                    raise ConnectionError(LEFT)
                n = header.payload_bytes
                payload = torch.frombuffer(bytearray(_read_exact(link.sock, n)), dtype=torch.uint8) if n else None
                self._arrived(header, payload if payload is not None else torch.empty(0, dtype=torch.uint8))
        except (OSError, ConnectionError, wire.WireError) as err:
            if not self._closed:
                self.deliver(Failure(peer, str(err)))
            with self._lock:
                if self._links.get(peer) is link:
                    del self._links[peer]
            link.close()

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
