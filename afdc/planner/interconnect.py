"""What one many-to-many message round costs a GPU: the AFD exchange and the EP all-to-all alike.

A GPU's peers lie partly inside its scale-up domain (NVLink, HCCS, UB) and partly beyond it,
reached over the scale-out NIC. The two fabrics carry their shares in parallel, so a round takes
the longer of the two shares' times, plus one per-message latency for each fabric used (the
dispatch or combine kernel's launch, synchronization and flight, which small decode batches pay
in full). This is the Baidu roofline's point (arXiv 2602.09721): on a scale-out cluster the NIC
caps how many tokens an FFN GPU can be fed, whatever its FLOP/s.
"""

from __future__ import annotations

from dataclasses import dataclass

from afdc.planner.hardware import HardwareProfile


@dataclass(frozen=True)
class Fabric:
    """One GPU's end of a fabric: bytes/s per direction and seconds per message."""

    bandwidth: float
    latency: float


def scale_up(hw: HardwareProfile) -> Fabric:
    return Fabric(hw.interconnect_bandwidth, hw.scale_up_latency)


def scale_out(hw: HardwareProfile) -> Fabric:
    return Fabric(hw.nic_bandwidth, hw.nic_latency)


def local_share(gpus: int, domain: int) -> float:
    """Share of a GPU's peers (``gpus`` in all, itself excluded) that sit in its own scale-up
    domain of ``domain`` GPUs, the GPUs filling whole domains."""
    if gpus <= 1:
        return 1.0
    return (min(gpus, domain) - 1) / (gpus - 1)


def shared_domain(hw_a: HardwareProfile, hw_f: HardwareProfile) -> bool:
    """Attention and FFN GPUs can share a scale-up domain only when they are the same chip."""
    return hw_a.name == hw_f.name


def round_time(nbytes: float, local: float, hw: HardwareProfile, efficiency: float) -> float:
    """Seconds for one GPU to move ``nbytes`` (one message round, one direction) to or from its
    peers, ``local`` of them inside its scale-up domain and the rest over the NIC."""
    if nbytes <= 0:
        return 0.0
    up, out = scale_up(hw), scale_out(hw)
    t_up = nbytes * local / (up.bandwidth * efficiency)
    t_out = nbytes * (1 - local) / (out.bandwidth * efficiency)
    latency = max(up.latency if local > 0 else 0.0, out.latency if local < 1 else 0.0)
    return max(t_up, t_out) + latency


def link_name(local: float) -> str:
    """What carries a round: the scale-up "interconnect", the "NIC", or both."""
    return "interconnect" if local >= 1 else "NIC" if local <= 0 else "interconnect+NIC"


def two_stage_round_time(
    gpu_bytes: float, domain_bytes: float, local: float, hw: HardwareProfile, efficiency: float
) -> float:
    """A round sent in two stages: ``domain_bytes`` (one copy per destination scale-up domain)
    cross the NIC for the ``1 - local`` share of peers beyond the domain, and ``gpu_bytes`` (one
    copy per destination GPU) cross the interconnect, where the receiving domain fans them out.
    The stages run one after the other per message, so both latencies count."""
    if gpu_bytes <= 0:
        return 0.0
    up, out = scale_up(hw), scale_out(hw)
    t_up = gpu_bytes / (up.bandwidth * efficiency)
    t_out = domain_bytes * (1 - local) / (out.bandwidth * efficiency)
    return max(t_up, t_out) + up.latency + (out.latency if local < 1 else 0.0)
