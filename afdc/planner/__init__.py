"""Deployment planner: from one decoded token's cost to an AFD plan ``xAyF`` and its rival.

The inputs are what the graph says a token costs (:func:`afdc.planner.cost.decode_cost`), the
weights each side holds (the split report's parameter counts times the weight dtype) and two
hardware profiles. The model of a decode step is a roofline per layer and per micro-batch:

- attention (data-parallel: every attention GPU holds all attention weights and whole
  requests) takes max(bytes read / HBM bandwidth, FLOPs / peak);
- the FFN side (expert-parallel across y GPUs, dense FFNs tensor-parallel) takes
  max(FLOPs / peak, bytes of the experts the micro-batch activates / HBM bandwidth);
- the hidden states cross the cut both ways once per layer and micro-batch;
- with m micro-batches ping-ponging, a layer takes max(a + f + c, m * max(a, f))
  (light-llm-simulator; the links count among the stages: m * max(a, f, c_out, c_back)), and m is
  the least with m >= 2(1 + Tc/Tf) (MegaScale-Infer).

The monolithic rival runs attention data-parallel and the FFN expert-parallel on the same GPUs
(DeepSeek-style), so its GPUs do both halves in turn and overlap only communication.

Dtypes: weights and KV are counted at the chosen dtypes (the graph is captured in the config's
dtype, so parameter counts are multiplied by the weight dtype's bytes and the KV walk is asked
for the KV dtype's); matmuls run at the weight dtype's peak where the chip has it, else at bf16
(weight-only quantization); the hidden states crossing the cut stay in the model's dtype.

Left out on purpose: kernel-launch and framework overheads beyond each message's fixed
latency, natural router skew (``Assumptions.expert_skew`` states it, 1 by default: balanced),
prefill sharing the GPUs, and tensor parallelism inside an attention rank (docs/planner.md).
Every figure is an estimate at datasheet rates scaled by
:class:`Assumptions`; it ranks deployments and names what binds them, it does not replace a
measurement.

The modules, each built on those before it:

- :mod:`~afdc.planner.hardware`: accelerator profiles (``afdc/data/hardware.json``, ``--hw-file``);
- :mod:`~afdc.planner.layers`: which decoder layers are identical, so a prefix capture stands for all;
- :mod:`~afdc.planner.cost`: one decoded token's FLOPs, KV and cut bytes, counted from the graphs
  (:class:`afdc.api.Built`: partitioned, bound to no weights);
- :mod:`~afdc.planner.facts`: those per layer, with each side's weights (:class:`ModelFacts`);
- :mod:`~afdc.planner.roofline`: one layer's times and memory on one GPU, and the A:F balance;
- :mod:`~afdc.planner.deployment`: a deployment's decode step and its largest batch under the target;
- :mod:`~afdc.planner.result`: the plan's result, as JSON and as text;
- :mod:`~afdc.planner.explain`: why the plan came out as it did;
- :mod:`~afdc.planner.search`: the plan search (:func:`plan`);
- :mod:`~afdc.planner.plotting`: ``--plot`` (matplotlib, imported only then).
"""

from afdc.planner.compare import Comparison, compare
from afdc.planner.cost import DecodeCost, decode_cost
from afdc.planner.deployment import Deployment, afd_step
from afdc.planner.facts import LayerFacts, ModelFacts, model_facts, split_for_planning
from afdc.planner.plotting import plot, plot_comparison, require_matplotlib
from afdc.planner.result import PlanResult, Shortfall
from afdc.planner.roofline import Assumptions, Balance, balance, fan_out, ffn_bytes_per_gpu, ffn_read_per_gpu
from afdc.planner.search import plan, ratio_curve

__all__ = [
    "Assumptions",
    "Balance",
    "Comparison",
    "DecodeCost",
    "Deployment",
    "LayerFacts",
    "ModelFacts",
    "PlanResult",
    "Shortfall",
    "afd_step",
    "balance",
    "compare",
    "decode_cost",
    "fan_out",
    "ffn_bytes_per_gpu",
    "ffn_read_per_gpu",
    "model_facts",
    "plan",
    "plot",
    "plot_comparison",
    "ratio_curve",
    "require_matplotlib",
    "split_for_planning",
]
