"""``--attn-tp 2`` on every catalogued architecture, checked against its monolith.

For each entry: how many of the attention side's parameters the TP ranks split (the rest is
whole on both), the worst logit error relative to the monolith's largest logit on a left-padded
batch, and whether 3 greedy tokens are the same; or why no attention weight can be split.
``tests/test_attention_tp.py`` checks seven of these rows in CI; this runs them all:

    python -m models_supported.attention_tp
"""

from __future__ import annotations

import torch

import afdc
from models_supported import catalog
from models_supported.table import _cell


def check(entry: catalog.ModelEntry, tp: int = 2) -> str:
    """One Markdown row for ``entry`` at ``--attn-tp tp``."""
    model = catalog.build(entry).eval()
    try:
        dm = afdc.disaggregate(model, "1A1F", attention_tp=tp)
    except afdc.PlanError as err:  # the first reason a weight was kept whole, as the error gives it
        reason = str(err).split(" ranks (", 1)[-1].split("; then ")[0]
        return f"| {entry.name} | 0% | - | - | {_cell(reason[:140])} |"
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(3, vocab, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
    got = dm(ids, attention_mask=mask).logits
    real = mask.bool()
    err = ((got[real] - ref[real]).abs().max() / ref[real].abs().max()).item()
    same = torch.equal(
        dm.generate(ids, mask, max_new_tokens=3, pad_token_id=0),
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0),
    )
    report = dm.report()
    share = report.attention_tp_split / report.attention_parameters
    return f"| {entry.name} | {share:.0%} | {err:.1e} | {'yes' if same else 'NO'} | |"


def main() -> None:
    print("| Architecture | attention parameters split | max rel. logit error | greedy tokens equal | why none |")
    print("|---|---:|---:|---|---|")
    for entry in catalog.ENTRIES:
        print(check(entry), flush=True)


if __name__ == "__main__":
    main()
