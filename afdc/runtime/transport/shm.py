"""The same-host transport: payloads through shared-memory rings, headers over Unix sockets.

Each attention rank connects to each FFN rank's Unix socket (abstract namespace, so nothing is
left on disk) and proves the deployment token for the current generation. Each direction of a
link gets a ring in ``/dev/shm`` created by its sender: the sender copies the payload into the
ring and writes header and ring position to the socket; the receiver copies it out and
publishes how far it has consumed in the ring's first bytes, which is how the sender knows
what it may overwrite. The socket carries the wake-up and tells at once when a peer dies
(end of stream). Ring files are unlinked as soon as both ends have mapped them.
"""

from __future__ import annotations

import contextlib
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
from afdc.runtime.transport.base import LEFT, Failure, Transport

log = logging.getLogger("afdc.shm")

_CONTROL = 64  # bytes before the ring's data: the consumed position (int64) written by the receiver
_POS = struct.Struct("<Q")
_INLINE = 2**64 - 1  # position meaning "the payload follows on the socket" (larger than the ring)
_SHM_DIR = Path("/dev/shm")
DEFAULT_RING_BYTES = 64 << 20


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


class _Ring:
    """One direction's shared-memory ring, mapped by both ends.

    The sender's copy and the control word go through memoryview and ``struct``: per message these
    are a few microseconds cheaper than torch ops, and a round trip is mostly such fixed costs.
    """

    def __init__(self, path: Path, size: int, create: bool):
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, _CONTROL + size)
            self.size = os.fstat(fd).st_size - _CONTROL
            self._mm = mmap.mmap(fd, _CONTROL + self.size)
        finally:
            os.close(fd)
        self.path = path
        self._view = memoryview(self._mm)
        self.head = 0  # sender only: where the next payload may start

    @property
    def tail(self) -> int:
        return _POS.unpack_from(self._mm, 0)[0]

    @tail.setter
    def tail(self, value: int) -> None:
        _POS.pack_into(self._mm, 0, value)

    def reserve(self, n: int, timeout: float, receiver: str) -> int:
        """Sender: the ring position where ``n`` bytes go once the receiver has freed the room."""
        deadline = time.monotonic() + timeout
        while True:
            head, tail = self.head, self.tail
            if tail == head:  # drained: start over at the beginning, whose pages are mapped and warm
                return head + (-head % self.size)
            start = head if head % self.size + n <= self.size else head + (-head % self.size)  # never wrap a payload
            if start + n - tail <= self.size:
                return start
            if time.monotonic() > deadline:
                raise ConnectionError(f"{receiver} has not consumed its ring for {timeout:g} s")
            time.sleep(1e-4)

    def write(self, offset: int, payload: memoryview) -> None:
        self._view[_CONTROL + offset : _CONTROL + offset + payload.nbytes] = payload

    def read(self, offset: int, n: int) -> torch.Tensor:
        """A copy of ``n`` bytes at ``offset``, as a uint8 tensor in torch's own (aligned) memory: the
        FFN and attention programs compute on it, and a matmul over a bytearray-backed tensor ran
        several times slower."""
        if n == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self._mm, dtype=torch.uint8, offset=_CONTROL + offset, count=n).clone()


class _Link:
    """A connected peer: the socket, the ring this end writes and the ring it reads."""

    def __init__(self, sock: socket.socket, out_ring: _Ring, in_ring: _Ring):
        self.sock, self.out_ring, self.in_ring = sock, out_ring, in_ring
        self.lock = threading.Lock()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class ShmTransport(Transport):
    ring_bytes = DEFAULT_RING_BYTES

    def _open(self) -> None:
        self._links: dict[int, _Link] = {}
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

    def _new_ring(self) -> _Ring:
        return _Ring(_SHM_DIR / f"afdc-{uuid.uuid4().hex}", self.ring_bytes, create=True)

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
        ring = self._new_ring()
        try:
            gen = self.group.generation
            proof = self.rendezvous.proof(gen, self.slot)
            sock.settimeout(self.timeout)
            _send_line(sock, {"slot": self.slot, "generation": gen, "proof": proof, "ring": str(ring.path)})
            reply = _read_line(sock)
            if "error" in reply:
                raise ConnectionError(f"refused by the FFN rank: {reply['error']}")
            in_ring = _Ring(Path(reply["ring"]), 0, create=False)
            _send_line(sock, {"mapped": True})
        finally:
            ring.path.unlink(missing_ok=True)
        sock.settimeout(None)
        self._start(peer, _Link(sock, ring, in_ring))

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._handshake, args=(sock,), daemon=True).start()

    def _handshake(self, sock: socket.socket) -> None:
        """Verify a connecting attention rank; a stranger is refused and logged, nothing else changes."""
        ring = None
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
            in_ring = _Ring(Path(hello["ring"]), 0, create=False)
            ring = self._new_ring()
            _send_line(sock, {"ring": str(ring.path)})
            _read_line(sock)  # the peer mapped our ring: it can go from the file system
            sock.settimeout(None)
            self._start(slot, _Link(sock, ring, in_ring))
        except (OSError, ValueError, KeyError, TypeError, ConnectionError) as err:
            log.warning("refused a connection: malformed handshake (%s)", err)
            sock.close()
        finally:
            if ring is not None:
                ring.path.unlink(missing_ok=True)

    def _start(self, peer: int, link: _Link) -> None:
        with self._lock:
            old = self._links.pop(peer, None)
            if old is not None:
                old.close()
            self._links[peer] = link
        threading.Thread(target=self._receive, args=(peer, link), daemon=True, name=f"afdc-shm-{peer}").start()

    def send(self, peer: int, header: wire.Header, tensors: list[torch.Tensor]) -> None:
        link = self._links.get(peer)
        if link is None:
            raise ConnectionError(f"no link to slot {peer}")
        payload = wire.pack(tensors).cpu()
        n = payload.numel()
        with link.lock:
            ring = link.out_ring
            if n > ring.size:
                link.sock.sendall(header.encode() + _POS.pack(_INLINE) + payload.numpy().tobytes())
                return
            start = ring.reserve(n, self.timeout, f"slot {peer}")
            ring.write(start % ring.size, memoryview(payload.numpy()))
            ring.head = start + n
            link.sock.sendall(header.encode() + _POS.pack(start))

    def _receive(self, peer: int, link: _Link) -> None:
        try:
            while True:
                head = _read_exact(link.sock, wire.HEADER_BYTES + _POS.size)
                header = wire.Header.decode(head[: wire.HEADER_BYTES])
                (pos,) = _POS.unpack_from(head, wire.HEADER_BYTES)
                if header.kind == wire.Kind.BYE:
                    raise ConnectionError(LEFT)
                n = header.payload_bytes
                if pos == _INLINE:
                    payload = torch.frombuffer(bytearray(_read_exact(link.sock, n)), dtype=torch.uint8)
                else:
                    ring = link.in_ring
                    offset = pos % ring.size
                    if offset + n > ring.size:
                        raise wire.WireError(f"ring position {pos} + {n} bytes runs past the ring")
                    payload = ring.read(offset, n)
                    ring.tail = pos + n
                self._arrived(header, payload)
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
