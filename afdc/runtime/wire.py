"""The wire format between attention and FFN ranks: a fixed-size binary header, then raw bytes.

Every message says what it is (step, FFN layer, micro-batch, token count, sender) and describes
its tensors (dtype and shape), so the FFN side never infers the layer from a call counter and
never unpickles anything. The payload is the tensors' bytes back to back.
"""

from __future__ import annotations

import enum
import functools
import math
import struct
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from afdc.errors import AfdcError
from afdc.runtime import trace

MAGIC = b"AFDC"
VERSION = 1
MAX_TENSORS = 8
MAX_DIMS = 6

_FIXED = struct.Struct("<4sBBH8sIQIIIIQB")  # magic .. payload bytes, tensor count
_TENSOR = struct.Struct(f"<BB{MAX_DIMS}q")
HEADER_BYTES = _FIXED.size + MAX_TENSORS * _TENSOR.size

# Codes on the wire; append only.
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool, torch.uint8, torch.int8]
_CODE = {dt: i for i, dt in enumerate(DTYPES)}


class WireError(AfdcError):
    """A message that is not afdc's, from another version, or inconsistent with its payload."""


class Kind(enum.IntEnum):
    DATA = 1  # attention -> FFN: the inputs of one FFN layer for one micro-batch
    RESULT = 2  # FFN -> attention: the outputs for that message
    ERROR = 3  # FFN -> attention: the message was refused; the payload is the reason (UTF-8)
    BYE = 4  # either way: the sender leaves this generation; nothing more comes on this link
    STEP = 5  # attention -> FFN: what a step holds; the payload is each micro-batch's token count (int64)


_KINDS = {int(k): k for k in Kind}  # by wire code: a dict lookup is cheaper than Kind(code)


# A tuple, not a dataclass: every header built or read hashes its specs (cached encodings and
# sizes are looked up by them), and a tuple hashes in C where a dataclass calls Python code.
class TensorSpec(NamedTuple):
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


# Not frozen: a frozen dataclass's __init__ costs ~1 us more per header, and a round trip builds
# and reads four of them on a path whose budget is tens of microseconds.
@dataclass(slots=True)
class Header:
    kind: Kind
    deployment: bytes  # 8 bytes naming the artifact and plan; messages for another are refused
    generation: int  # the rendezvous generation the sender is in
    step: int
    layer: int
    micro_batch: int
    tokens: int
    sender: int  # the sender's slot in the deployment (attention ranks first, then FFN ranks)
    tensors: tuple[TensorSpec, ...] = field(default=())
    payload_bytes: int = 0

    @classmethod
    @trace.phase("header.build")
    def carrying(
        cls, kind: Kind, tensors: list[torch.Tensor], deployment: bytes, generation: int, step: int, layer: int,
        micro_batch: int, tokens: int, sender: int,
    ) -> Header:
        """A header describing ``tensors`` as its payload, with the other header fields."""
        described = specs(tensors)
        return cls(
            kind, deployment, generation, step, layer, micro_batch, tokens, sender, described, _payload_bytes(described)
        )

    @property
    def key(self) -> tuple[int, int, int]:
        """What a reply answers: (step, layer, micro-batch)."""
        return self.step, self.layer, self.micro_batch

    @trace.phase("header.encode")
    def encode(self) -> bytes:
        out = bytearray(HEADER_BYTES)
        self.encode_into(out, 0)
        return bytes(out)

    def encode_into(self, buffer, offset: int) -> None:
        """Write the header into ``buffer`` (writable, :data:`HEADER_BYTES` from ``offset``): a
        shared-memory slot takes it in place, with no bytes object made and copied on the way."""
        if len(self.tensors) > MAX_TENSORS:
            raise WireError(f"a message carries at most {MAX_TENSORS} tensors, got {len(self.tensors)}")
        _FIXED.pack_into(
            buffer,
            offset,
            MAGIC,
            VERSION,
            int(self.kind),
            0,
            self.deployment,
            self.generation,
            self.step,
            self.layer,
            self.micro_batch,
            self.tokens,
            self.sender,
            self.payload_bytes,
            len(self.tensors),
        )
        described = _encode_specs(self.tensors)  # the rest of the header is never read (count says so)
        buffer[offset + _FIXED.size : offset + _FIXED.size + len(described)] = described

    @classmethod
    def decode(cls, data: bytes) -> Header:
        if len(data) != HEADER_BYTES:
            raise WireError(f"header of {len(data)} bytes, expected {HEADER_BYTES}")
        return cls.decode_from(data, 0)

    @classmethod
    @trace.phase("header.decode")
    def decode_from(cls, buffer, offset: int) -> Header:
        """The header at ``offset`` of ``buffer`` (:data:`HEADER_BYTES` there: the caller's bound),
        read in place."""
        magic, version, kind, _, deployment, gen, step, layer, mb, tokens, sender, payload, count = _FIXED.unpack_from(
            buffer, offset
        )
        if magic != MAGIC:
            raise WireError(f"not an afdc message (magic {magic!r})")
        if version != VERSION:
            raise WireError(f"wire version {version}, this afdc speaks {VERSION}; run the same afdc on every rank")
        if kind not in _KINDS or count > MAX_TENSORS:
            raise WireError(f"malformed header (kind {kind}, {count} tensors)")
        start = offset + _FIXED.size
        tensors = _decode_specs(bytes(buffer[start : start + count * _TENSOR.size]))
        header = cls(_KINDS[kind], deployment, gen, step, layer, mb, tokens, sender, tensors, payload)
        if payload != _payload_bytes(tensors):  # an ERROR's reason is a uint8 tensor too
            raise WireError(f"payload of {payload} bytes does not match its tensors {tensors}")
        return header


# A deployment sends the same few tensor layouts over and over: their encodings are cached, which
# takes a few microseconds off every message of a round trip that is mostly such fixed costs.
@functools.lru_cache(maxsize=4096)
def _encode_specs(tensors: tuple[TensorSpec, ...]) -> bytes:
    return b"".join(_encode_spec(t) for t in tensors)


@functools.lru_cache(maxsize=4096)
def _decode_specs(data: bytes) -> tuple[TensorSpec, ...]:
    return tuple(_decode_spec(data, i * _TENSOR.size) for i in range(len(data) // _TENSOR.size))


def _encode_spec(t: TensorSpec) -> bytes:
    if len(t.shape) > MAX_DIMS:
        raise WireError(f"tensors on the wire have at most {MAX_DIMS} dims, got shape {t.shape}")
    if t.dtype not in _CODE:
        raise WireError(f"dtype {t.dtype} cannot be sent; supported: {DTYPES}")
    return _TENSOR.pack(_CODE[t.dtype], len(t.shape), *t.shape, *([0] * (MAX_DIMS - len(t.shape))))


def _decode_spec(data: bytes, offset: int) -> TensorSpec:
    code, ndim, *dims = _TENSOR.unpack_from(data, offset)
    if code >= len(DTYPES) or ndim > MAX_DIMS or any(d < 0 for d in dims[:ndim]):
        raise WireError(f"malformed tensor description (dtype code {code}, {ndim} dims)")
    return TensorSpec(DTYPES[code], tuple(dims[:ndim]))


def specs(tensors: list[torch.Tensor]) -> tuple[TensorSpec, ...]:
    return tuple(_spec(t.dtype, t.shape) for t in tensors)


@functools.lru_cache(maxsize=4096)
def _spec(dtype: torch.dtype, shape: torch.Size) -> TensorSpec:
    return TensorSpec(dtype, tuple(shape))


@functools.lru_cache(maxsize=4096)
def _payload_bytes(tensors: tuple[TensorSpec, ...]) -> int:
    return sum(t.nbytes for t in tensors)


def nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes back to back, as one uint8 tensor on their device."""
    if not tensors:
        return torch.empty(0, dtype=torch.uint8)
    flat = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    return torch.cat(flat) if len(flat) > 1 else flat[0]


def unpack(payload: torch.Tensor, tensor_specs: tuple[TensorSpec, ...]) -> list[torch.Tensor]:
    """Views of ``payload`` (uint8) as the described tensors."""
    if len(tensor_specs) == 1:  # the common message, without the slicing
        (spec,) = tensor_specs
        return [payload.view(spec.dtype).reshape(spec.shape)]
    out, offset = [], 0
    for spec in tensor_specs:
        chunk = payload[offset : offset + spec.nbytes]
        if offset % spec.dtype.itemsize:  # a dtype view needs an aligned start
            chunk = chunk.clone()
        out.append(chunk.view(spec.dtype).reshape(spec.shape))
        offset += spec.nbytes
    return out
