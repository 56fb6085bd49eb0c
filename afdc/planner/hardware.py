"""Accelerator profiles for the planner: peak FLOP/s, memory, links and an indicative price.

The built-in profiles live in ``afdc/data/hardware.json`` (public datasheet figures, dense, no
sparsity; each profile's ``sources`` names where each figure comes from). Users add or override
profiles with a file of the same schema (``--hw-file``): a profile whose name matches a built-in
one replaces it.

Two fabrics join the GPUs: the scale-up domain (NVLink, HCCS, Ascend's unified bus), of
``scale_up_domain`` GPUs at ``interconnect_bandwidth`` each, and the scale-out network (the NIC)
at ``nic_bandwidth``. Each also costs a fixed ``*_latency`` per message (launch, synchronization
and flight of one dispatch or combine), which is what small decode batches pay most.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from afdc.errors import AfdcError

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}


class HardwareError(AfdcError, ValueError):
    """An unknown hardware name or a malformed hardware file."""


@dataclass(frozen=True)
class HardwareProfile:
    """One accelerator; every bandwidth is bytes/s in one direction, capacities are bytes."""

    name: str
    peak_flops: dict[str, float]  # dense FLOP/s per compute dtype ("bf16", "fp8", "int8")
    hbm_bandwidth: float
    hbm_capacity: float
    interconnect_bandwidth: float  # scale-up link (NVLink, HCCS, PCIe) per GPU
    nic_bandwidth: float  # scale-out network per GPU
    price_per_hour: float | None = None  # USD per GPU-hour, indicative
    scale_up_domain: int = 8  # GPUs that reach each other over the interconnect
    scale_up_latency: float = 0.0  # seconds per message (one dispatch or combine) on the interconnect
    nic_latency: float = 0.0  # seconds per message on the scale-out network
    description: str = ""
    note: str = ""
    aliases: tuple[str, ...] = field(default=())
    sources: dict[str, str] = field(default_factory=dict)  # figure -> where it comes from

    def flops(self, dtype: str) -> float:
        """Peak dense FLOP/s for matmuls in ``dtype``; a dtype the chip lacks runs at bf16 rate
        (weight-only quantization: weights are widened to bf16 before the multiply)."""
        return self.peak_flops.get(dtype) or self.peak_flops["bf16"]

    def runs_natively(self, dtype: str) -> bool:
        return dtype in self.peak_flops


_REQUIRED = ("name", "peak_flops", "hbm_bandwidth", "hbm_capacity", "interconnect_bandwidth", "nic_bandwidth")


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _profile(entry: dict, source: str) -> HardwareProfile:
    missing = [k for k in _REQUIRED if k not in entry]
    if missing:
        raise HardwareError(f"{source}: profile {entry.get('name', '?')!r} lacks {', '.join(missing)}")
    if "bf16" not in entry["peak_flops"]:
        raise HardwareError(f"{source}: profile {entry['name']!r} needs a bf16 entry in peak_flops")
    known = {f for f in HardwareProfile.__dataclass_fields__}
    unknown = sorted(set(entry) - known)
    if unknown:
        raise HardwareError(f"{source}: profile {entry['name']!r} has unknown fields {unknown}; known: {sorted(known)}")
    values = dict(entry)
    values["peak_flops"] = {k: float(v) for k, v in entry["peak_flops"].items()}
    values["aliases"] = tuple(entry.get("aliases", ()))
    sources = entry.get("sources", {})
    if not isinstance(sources, dict) or not all(isinstance(v, str) for v in sources.values()):
        raise HardwareError(f"{source}: profile {entry['name']!r}: sources must map field names to strings")
    stray = sorted(set(sources) - known)
    if stray:
        raise HardwareError(f"{source}: profile {entry['name']!r} names sources for unknown fields {stray}")
    if int(entry.get("scale_up_domain", 1)) < 1:
        raise HardwareError(f"{source}: profile {entry['name']!r}: scale_up_domain must be at least 1")
    return HardwareProfile(**values)


def _read(text: str, source: str) -> list[HardwareProfile]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise HardwareError(f"{source}: not valid JSON ({err})") from err
    entries = data.get("profiles") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise HardwareError(f'{source}: expected {{"profiles": [...]}} or a list of profiles')
    return [_profile(e, source) for e in entries]


def load_profiles(extra_file: str | Path | None = None) -> dict[str, HardwareProfile]:
    """The built-in profiles, then those of ``extra_file`` (same schema), by name."""
    text = resources.files("afdc").joinpath("data/hardware.json").read_text()
    profiles = {p.name: p for p in _read(text, "afdc/data/hardware.json")}
    if extra_file is not None:
        path = Path(extra_file)
        if not path.is_file():
            raise HardwareError(f"hardware file {str(path)!r} does not exist")
        for p in _read(path.read_text(), str(path)):
            replaced = _find(profiles, p.name)
            if replaced is not None:
                del profiles[replaced]
            profiles[p.name] = p
    return profiles


def _find(profiles: dict[str, HardwareProfile], name: str) -> str | None:
    want = _key(name)
    for key, p in profiles.items():
        if want in {_key(p.name), *(_key(a) for a in p.aliases)}:
            return key
    return None


def get_profile(name: str, profiles: dict[str, HardwareProfile] | None = None) -> HardwareProfile:
    """The profile called ``name`` (case, spaces and dashes ignored)."""
    profiles = load_profiles() if profiles is None else profiles
    key = _find(profiles, name)
    if key is None:
        raise HardwareError(
            f"unknown hardware {name!r}; known: {', '.join(sorted(profiles))} (add your own with --hw-file)"
        )
    return profiles[key]


def dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise HardwareError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]
