"""Which of vLLM's ``--speculative-config`` afdc serves: n-gram prompt lookup, any model, and
``mtp`` (or vLLM's per-model names for it, ``deepseek_mtp``, ...) for an artifact compiled with
the model's own multi-token-prediction layer (:mod:`afdc.mtp`). Every other method needs a
drafter that is not in the artifact: a draft model, or EAGLE or Medusa heads. They are refused
before the server starts (``afdc serve``, ``afdc up``) and by afdc's vLLM platform (``vllm
serve`` run by hand), with the reason.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, get_args

if TYPE_CHECKING:
    from afdc.artifact.manifest import Manifest

# what --speculative-config's methods would need of afdc, by method (vLLM's names); "ngram" needs nothing
_NEEDS = {
    "draft_model": "a separate draft model, which would need an artifact of its own",
    "eagle": "EAGLE heads, which afdc does not capture or compile",
    "eagle3": "EAGLE-3 heads, which afdc does not capture or compile",
    "medusa": "Medusa heads, which afdc does not capture or compile",
    "mlp_speculator": "an MLP speculator model, which afdc does not capture or compile",
    "mtp": "the model's multi-token-prediction layers, which this artifact does not hold (its config counts none)",
    "ngram_gpu": "vLLM's GPU n-gram proposer, which lives in vLLM's own model runner; 'ngram' proposes on the host",
}


# fields that change how drafts are made or checked, which afdc's worker would otherwise ignore: the
# values it serves (vLLM's default), and what it does instead; vLLM keeps them as given, so the
# platform checks them for ``vllm serve`` by hand too
DRAFTING = {
    "draft_sample_method": (("greedy",), "afdc's drafters propose greedily"),
    "rejection_sample_method": (("standard",), "afdc verifies with vLLM's standard rejection sampler"),
    "parallel_drafting": ((False,), "afdc's MTP drafter proposes one draft per pass"),
}
# the draft model runner's settings, which vLLM fills in itself: checked as given to afdc serve / up
_DRAFT_RUNNER = {
    "draft_tensor_parallel_size": ((None, 1), "afdc's MTP drafter runs on its attention rank, on one TP rank"),
    "quantization": ((None,), "afdc's MTP drafter is compiled into the artifact, unquantized"),
    "kv_cache_dtype": ((None,), "afdc's MTP drafter caches keys and values in the model's dtype"),
    "attention_backend": ((None,), "afdc's drafter runs the artifact's program, under afdc serve's --backend"),
    "moe_backend": ((None,), "afdc's drafter runs the artifact's program, under afdc serve's --backend"),
    "max_model_len": ((None,), "afdc's MTP drafter drafts at every position the model serves"),
}


def refusal(config: dict | None, mtp_methods: Sequence[str] = (), drafter: str | None = None,
            no_drafter: str = "") -> str | None:
    """Why afdc cannot serve the speculative decoding ``config`` (``--speculative-config``'s
    fields); None when it can (no speculation, ``ngram``, or ``mtp`` with an artifact that holds
    the MTP drafter, with no setting afdc would ignore). ``mtp_methods``: vLLM's per-model names
    for MTP (``deepseek_mtp``, ...); ``drafter``: the method of the drafter compiled into the
    artifact (the manifest's), if any; ``no_drafter``: why the artifact has none (the manifest's)."""
    if not config:
        return None
    method = config.get("method") or ("draft_model" if config.get("model") else None)
    if method in mtp_methods:
        method = "mtp"
    if method in ("ngram", drafter) and not config.get("model"):
        return _ignored(config)
    needs = _NEEDS.get(method, f"a '{method}' drafter, which afdc does not run")
    if method == "mtp" and no_drafter:
        needs = f"the model's multi-token-prediction layers, which this artifact does not hold: {no_drafter}"
    also = ", or the model's own MTP layers: {\"method\": \"mtp\", ...}" if drafter == "mtp" else ""
    return (f"--speculative-config method {config.get('method') or method!r} needs {needs}; afdc's worker "
            "speculates with n-gram prompt lookup: {\"method\": \"ngram\", \"num_speculative_tokens\": K}" + also)


def artifact_refusal(config: dict | None, manifest: Manifest) -> str | None:
    """:func:`refusal` of ``config`` for the artifact ``manifest`` describes, under vLLM's names for MTP."""
    from vllm.config.speculative import MTPModelTypes  # vLLM is imported only where a server starts

    drafter = manifest.drafter.method if manifest.drafter else None
    return refusal(config, get_args(MTPModelTypes), drafter, manifest.no_drafter)


def _ignored(config: dict) -> str | None:
    """Why a setting of ``config`` (a method afdc serves) would be ignored, if one would."""
    for name, (served, instead) in {**DRAFTING, **_DRAFT_RUNNER}.items():
        if config.get(name) not in (None, *served):
            return (f"--speculative-config {name}={config[name]!r} is not served by afdc's worker ({instead}); "
                    f"leave it out")
    return None


def config_in_args(vllm_args: Sequence[str]) -> dict | None:
    """The ``--speculative-config`` (``-sc``) JSON of a ``vllm serve`` command line, if any."""
    args = list(vllm_args)
    for i, arg in enumerate(args):
        name, _, value = arg.partition("=")
        if name in ("--speculative-config", "-sc"):
            raw = value if value else (args[i + 1] if i + 1 < len(args) else "")
            try:
                config = json.loads(raw)
            except json.JSONDecodeError as err:
                raise ValueError(f"--speculative-config {raw!r} is not JSON ({err})") from None
            if not isinstance(config, dict):
                raise ValueError(f"--speculative-config {raw!r} is not a JSON object")
            return config
    return None
