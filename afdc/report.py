"""The split report: per FFN layer what kind of FFN it is and what crosses the cut each way."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import torch
import torch.fx as fx

from afdc.mixer_site import MixerSite
from afdc.ops import AttentionCall
from afdc.partition.cut import Cut
from afdc.passes import graph_facts as gf


@dataclass
class Crossing:
    name: str
    shape_per_token: list[int] | None  # None when the value is not laid out token-major
    dtype: str
    bytes_per_token: float


@dataclass(kw_only=True)
class LayerReport:
    index: int
    module: str
    kind: str  # "dense" or "moe"
    experts: int | None
    top_k: int | None
    segment: int
    to_ffn: list[Crossing]
    to_attn: list[Crossing]
    ffn_parameters: int
    # the FFN weights as the checkpoint stores them (quantized: data and scales; persistent buffers included)
    ffn_weight_bytes: int = 0
    expert_weight_bytes: int = 0  # of which the stacked routed experts' tensors (all experts)
    ffn_split: str = "replicated"  # how the FFN ranks share the layer: "ep", "tp" or "replicated"
    ranks_per_token: int = 1  # FFN ranks each token goes to and comes back from under the plan
    routed: bool = False  # only to its experts' ranks: ranks_per_token bounds it, as does top_k

    @property
    def bytes_to_ffn(self) -> float:
        return sum(c.bytes_per_token for c in self.to_ffn)

    @property
    def bytes_to_attn(self) -> float:
        return sum(c.bytes_per_token for c in self.to_attn)

    @property
    def fan_out(self) -> int:
        """FFN ranks a token goes to and comes back from; routed, the most it can."""
        return min(self.ranks_per_token, self.top_k) if self.routed and self.top_k else self.ranks_per_token

    @property
    def wire_bytes(self) -> float:
        """Bytes per token on the wire both ways, each copy to and from every rank counted."""
        return (self.bytes_to_ffn + self.bytes_to_attn) * self.fan_out


@dataclass(kw_only=True)
class Report:
    model: str
    plan: str
    router: str
    decode_recomputes: str  # why decode recomputes the prefix ("": it decodes against the KV cache)
    attention_calls: int
    attention_parameters: int
    ffn_parameters: int
    segment_graphs: int
    layers: list[LayerReport] = field(default_factory=list)
    # the attention side's stored tensors (parameters, persistent buffers) as stored (quantized: data and scales)
    attention_weight_bytes: int = 0
    ffn_weight_bytes: int = 0  # the FFN side's, likewise
    attention_tp: int = 1
    attention_tp_split: int = 0  # attention-side parameters split over the TP ranks (the rest is whole)
    max_positions: int | None = None  # the longest key length the captured graph is valid for
    kv_bytes_per_token: int = 0  # keys and values the attention calls cache, per token of a sequence
    mixers: list[MixerSite] = field(default_factory=list)  # stateful mixers, with their state per sequence

    @property
    def mixer_state_bytes(self) -> int:
        """Bytes of stateful-mixer state per sequence (any length)."""
        return sum(m.state_bytes for m in self.mixers)

    @property
    def incremental_decode(self) -> bool:
        return not self.decode_recomputes

    @property
    def bytes_to_ffn(self) -> float:
        return sum(layer.bytes_to_ffn for layer in self.layers)

    @property
    def bytes_to_attn(self) -> float:
        return sum(layer.bytes_to_attn for layer in self.layers)

    @property
    def wire_bytes(self) -> float:
        return sum(layer.wire_bytes for layer in self.layers)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["mixer_state_bytes_per_sequence"] = self.mixer_state_bytes
        d["bytes_per_token_to_ffn"] = self.bytes_to_ffn
        d["bytes_per_token_to_attn"] = self.bytes_to_attn
        d["wire_bytes_per_token"] = self.wire_bytes
        for layer, out in zip(self.layers, d["layers"]):
            out["wire_bytes_per_token"] = layer.wire_bytes
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        def crossings(cs: list[Crossing]) -> str:
            return ", ".join(f"{c.shape_per_token or '?'} {c.dtype}" for c in cs)

        lines = [
            f"model {self.model}  plan {self.plan}  router on {self.router} side",
            f"attention side: {self.attention_parameters:,} parameters "
            f"({_mib(self.attention_weight_bytes)} as stored), {self.attention_calls} attention calls"
            + (f" (decode recomputes the prefix: {self.decode_recomputes})" if self.decode_recomputes else "")
            + (f"; valid for at most {self.max_positions} positions" if self.max_positions else "")
            + (
                f"; TP over {self.attention_tp}: {self.attention_tp_split:,} parameters split, the rest whole"
                if self.attention_tp > 1 else ""
            ),
            f"cached per sequence: {self.kv_bytes_per_token:,} bytes of keys and values per token"
            + (
                f", {self.mixer_state_bytes:,} bytes of state in {len(self.mixers)} stateful mixers (any length)"
                if self.mixers else ""
            ),
            *(
                f"  mixer {m.module} (cache layer {m.layer}): "
                + (", ".join(f"{t.name} {list(t.shape)} {t.dtype}" for t in m.state) if m.fixed_state else
                   "state that grows with the sequence (its own keys, compressed entries), in the model's cache "
                   f"layer; takes {', '.join(m.inputs)}")
                + (" - whole on every TP rank (the op runs the module's own code)" if self.attention_tp > 1 else "")
                for m in self.mixers
            ),
            f"FFN side:       {self.ffn_parameters:,} parameters ({_mib(self.ffn_weight_bytes)} as stored) in "
            f"{len(self.layers)} layers, "
            f"{self.segment_graphs} distinct segment graph(s)",
            "",
            f"{'layer':>5}  {'module':<28} {'ffn':<19} {'to FFN (per token)':<26} {'to attn':<20} {'B/tok':>8}"
            f" {'ranks':>6} {'wire B/tok':>11}",
        ]
        for r in self.layers:
            kind = f"moe {r.experts}e top-{r.top_k or '?'}" if r.kind == "moe" else "dense"
            if r.ffn_split != "replicated":
                kind += f" {r.ffn_split}"  # how the FFN ranks split it
            ranks = f"{'<=' if r.routed else ''}{r.fan_out}"
            lines.append(
                f"{r.index:>5}  {r.module[-28:]:<28} {kind:<19} {crossings(r.to_ffn):<26} "
                f"{crossings(r.to_attn):<20} {r.bytes_to_ffn + r.bytes_to_attn:>8.0f} {ranks:>6} {r.wire_bytes:>11.0f}"
            )
        routed = any(r.routed for r in self.layers)
        lines.append(
            f"total bytes per token: {self.bytes_to_ffn:,.0f} to FFN, {self.bytes_to_attn:,.0f} to attention; "
            f"{'at most ' if routed else ''}{self.wire_bytes:,.0f} on the wire (to and from each of a token's "
            "FFN ranks)"
        )
        return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def kv_bytes_per_token(graph: fx.Graph) -> int:
    """Bytes of keys and values the graph's attention calls cache per token of a sequence."""
    total = 0
    for call in AttentionCall.all_in(graph):
        for x in (call.k, call.v):
            val = x.meta.get("val")
            if val is not None and val.dim() == 4:  # [b, heads, s, d]
                total += int(val.shape[1]) * int(val.shape[3]) * val.dtype.itemsize
    return total


def _crossing(node: fx.Node, tokens) -> Crossing:
    shape = gf.per_token_shape(node, tokens)
    dtype = str(node.meta["val"].dtype).removeprefix("torch.")
    return Crossing(node.name, list(shape) if shape is not None else None, dtype, gf.bytes_per_token(node, tokens))


def _moe_shape(cut: Cut) -> tuple[int, int | None] | None:
    """(experts, top-k) of a routed FFN: a top-k selection, or expert weights stacked in one
    tensor (some routers select with ``max`` instead); top-k is None when no top-k op says it."""
    # grouped routing selects groups before experts: the expert selection is the last top-k
    for n in reversed(cut.region.nodes):
        if gf.is_op(n, torch.ops.aten.topk):
            scores, k = n.args[0], n.args[1]
            return int(scores.meta["val"].shape[-1]), int(k)
    stacked = [n for n in cut.region.nodes if n.op == "get_attr" and n.meta["val"].ndim >= 3]
    return (int(stacked[0].meta["val"].shape[0]), None) if stacked else None


def layer_report(cut: Cut, segment: int, tokens, params: set[str]) -> LayerReport:
    moe = _moe_shape(cut)
    n_params = sum(n.meta["val"].numel() for n in cut.ffn_nodes if gf.is_parameter(n, params))
    return LayerReport(
        index=cut.region.index,
        module=cut.region.label,
        kind="moe" if moe else "dense",
        experts=moe[0] if moe else None,
        top_k=moe[1] if moe else None,
        segment=segment,
        to_ffn=[_crossing(n, tokens) for n in cut.to_ffn],
        to_attn=[_crossing(n, tokens) for n in cut.to_attn],
        ffn_parameters=n_params,
    )
