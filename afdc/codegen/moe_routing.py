"""MoE routing, router logits to each token's top-k experts and weights: Triton kernel, PyTorch
reference, custom op.

It covers the routers of transformers' MoE models: softmax top-k with optional renormalisation
(Mixtral, Qwen-MoE), DeepSeek-V2's group-limited greedy (a group scores its best expert) and
DeepSeek-V3's sigmoid router (score correction bias, a group scores its two best experts,
renormalisation, routed scaling). The bias only steers the choice; the weights are the unbiased
scores of the chosen experts.

Ids come out in descending order of choice (``torch.topk(sorted=True)``); transformers asks for
``sorted=False`` in places, which only permutes the k slots of a token and changes no MoE output.
The masked-out groups' experts are -inf, as DeepSeek-V3 masks them; DeepSeek-V2 masks its softmax
scores to 0 instead, which picks the same experts whenever top_k fits in the kept groups.
"""

from __future__ import annotations

import torch

from afdc.codegen.triton_support import jit, launches, next_power_of_2, tl

SCORINGS = ("softmax", "sigmoid")
GROUP_SCORES = ("max", "top2_sum")

# DeepSeek-V3's renormalisation denominator guard. Other routers (Qwen-MoE) add nothing, but their
# top-k softmax mass is at least top_k / E, where 1e-20 is far below one ulp: the results agree.
_RENORM_EPS = 1e-20


def _check(logits: torch.Tensor, top_k: int, scoring: str, n_group: int, topk_group: int, group_score: str) -> None:
    if scoring not in SCORINGS:
        raise ValueError(f"moe_route: unknown scoring {scoring!r}; expected one of {', '.join(SCORINGS)}")
    if group_score not in GROUP_SCORES:
        raise ValueError(f"moe_route: unknown group_score {group_score!r}; expected one of {', '.join(GROUP_SCORES)}")
    if logits.dim() != 2:
        raise ValueError(f"moe_route: logits must be [tokens, experts], got {tuple(logits.shape)}")
    num_experts = logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"moe_route: top_k {top_k} out of range for {num_experts} experts")
    if n_group > 1:
        if num_experts % n_group:
            raise ValueError(f"moe_route: {num_experts} experts do not split into {n_group} groups")
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"moe_route: topk_group {topk_group} out of range for {n_group} groups")
        if group_score == "top2_sum" and num_experts // n_group < 2:
            raise ValueError("moe_route: group_score 'top2_sum' needs at least 2 experts per group")


def _mask_groups(choice: torch.Tensor, n_group: int, topk_group: int, group_score: str) -> torch.Tensor:
    """``choice`` with the experts outside each token's ``topk_group`` best groups set to -inf."""
    tokens, num_experts = choice.shape
    grouped = choice.view(tokens, n_group, num_experts // n_group)
    group_scores = grouped.max(dim=-1).values if group_score == "max" else grouped.topk(2, dim=-1)[0].sum(dim=-1)
    kept_groups = torch.topk(group_scores, k=topk_group, dim=-1)[1]
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    kept = kept.unsqueeze(-1).expand_as(grouped).reshape(tokens, num_experts)
    return choice.masked_fill(~kept, float("-inf"))


def moe_route_reference(
    logits: torch.Tensor,
    top_k: int,
    scoring: str,
    renormalize: bool,
    n_group: int,
    topk_group: int,
    group_score: str,
    bias: torch.Tensor | None,
    routed_scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(logits, top_k, scoring, n_group, topk_group, group_score)
    logits = logits.float()
    scores = logits.softmax(dim=-1) if scoring == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias.float()
    if n_group > 1:
        choice = _mask_groups(choice, n_group, topk_group, group_score)
    ids = torch.topk(choice, k=top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + _RENORM_EPS)
    return weights * routed_scaling, ids


def _moe_route_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    logits_row_stride,
    top_k,
    n_group,
    group_size,
    topk_group,
    routed_scaling,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUPED: tl.constexpr,
    TOP2_SUM: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # One program per token, its experts held as a [group, expert in group] tile: group sizes need
    # not be powers of two (DeepSeek-V2: 160 experts in 8 groups), so each axis is padded alone.
    token = tl.program_id(0).to(tl.int64)
    groups = tl.arange(0, BLOCK_G)
    members = tl.arange(0, BLOCK_E)
    experts = groups[:, None] * group_size + members[None, :]
    valid = (groups[:, None] < n_group) & (members[None, :] < group_size)

    x = tl.load(logits_ptr + token * logits_row_stride + experts, mask=valid, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = tl.sigmoid(x)
    else:
        e = tl.exp(x - tl.max(x))
        scores = e / tl.sum(e)
    scores = tl.where(valid, scores, 0.0)
    choice = scores
    if HAS_BIAS:
        choice += tl.load(bias_ptr + experts, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))

    if GROUPED:
        best = tl.max(choice, 1)
        if TOP2_SUM:
            # the runner-up: the best again with the first position holding the best left out
            first = tl.where(choice == best[:, None], members[None, :], BLOCK_E)
            first = tl.min(first, 1)
            second = tl.where(members[None, :] == first[:, None], float("-inf"), choice)
            best += tl.max(second, 1)
        group_free = groups < n_group
        kept = groups < 0
        for _ in range(topk_group):
            top = tl.max(tl.where(group_free, best, float("-inf")), 0)
            pick = tl.min(tl.where(group_free & (best == top), groups, BLOCK_G), 0)
            kept = kept | (groups == pick)
            group_free = group_free & (groups != pick)
        choice = tl.where(kept[:, None], choice, float("-inf"))

    # top_k rounds of argmax; ties go to the lowest expert id. A taken expert leaves `free` rather
    # than being set to -inf, so a round among -inf choices still picks an untaken expert.
    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    free = valid
    for k in range(top_k):
        top = tl.max(tl.where(free, choice, float("-inf")))
        pick = tl.where(free & (choice == top), experts, BLOCK_G * BLOCK_E)
        pick = tl.min(pick)
        weight = tl.sum(tl.where(experts == pick, scores, 0.0))
        weights = tl.where(slots == k, weight, weights)
        ids = tl.where(slots == k, pick.to(tl.int64), ids)
        free = free & (experts != pick)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, 0) + 1e-20)
    out = slots < top_k
    tl.store(weights_ptr + token * top_k + slots, weights * routed_scaling, mask=out)
    tl.store(ids_ptr + token * top_k + slots, ids, mask=out)


def moe_route_triton(
    logits: torch.Tensor,
    top_k: int,
    scoring: str,
    renormalize: bool,
    n_group: int,
    topk_group: int,
    group_score: str,
    bias: torch.Tensor | None,
    routed_scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(logits, top_k, scoring, n_group, topk_group, group_score)
    tokens, num_experts = logits.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    if tokens == 0:
        return weights, ids
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    groups = max(n_group, 1)
    group_size = num_experts // groups
    jit(_moe_route_kernel)[(tokens,)](
        logits,
        logits if bias is None else bias.contiguous(),  # any pointer: HAS_BIAS=False never reads it
        weights,
        ids,
        logits.stride(0),
        top_k,
        groups,
        group_size,
        topk_group,
        float(routed_scaling),
        SIGMOID=scoring == "sigmoid",
        HAS_BIAS=bias is not None,
        GROUPED=groups > 1,
        TOP2_SUM=group_score == "top2_sum",
        RENORMALIZE=renormalize,
        BLOCK_G=next_power_of_2(groups),
        BLOCK_E=next_power_of_2(group_size),
        BLOCK_K=next_power_of_2(top_k),
    )
    return weights, ids


@torch.library.custom_op("afdc::moe_route", mutates_args=())
def moe_route(
    logits: torch.Tensor,
    top_k: int,
    scoring: str,
    renormalize: bool,
    n_group: int,
    topk_group: int,
    group_score: str,
    bias: torch.Tensor | None,
    routed_scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts: ``(weights [T, K] float32, ids [T, K] int64)``.

    ``scoring`` is ``softmax`` or ``sigmoid``; ``bias`` (optional, [E]) is added to the scores to
    choose the experts only; ``n_group > 1`` limits the choice to the ``topk_group`` groups of best
    ``group_score`` (``max`` or ``top2_sum``); the weights are the chosen experts' scores,
    renormalised to sum to one when ``renormalize``, times ``routed_scaling``.
    """
    args = (logits, top_k, scoring, renormalize, n_group, topk_group, group_score, bias, routed_scaling)
    if launches(*(t for t in (logits, bias) if t is not None)):
        return moe_route_triton(*args)
    return moe_route_reference(*args)


@moe_route.register_fake
def _(logits, top_k, scoring, renormalize, n_group, topk_group, group_score, bias, routed_scaling):
    _check(logits, top_k, scoring, n_group, topk_group, group_score)
    shape = (logits.shape[0], top_k)
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int64)
