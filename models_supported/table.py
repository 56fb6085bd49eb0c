"""The support table: every catalogued architecture, verified or refused, as Markdown.

Built from the catalog alone (no model is built), so it is instant; the tests in
``tests/test_models_supported.py`` are what back each "verified" and "refused" claim.

    python -m models_supported.table
"""

from __future__ import annotations

from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from models_supported.catalog import ENTRIES, FAMILIES, REFUSED, REFUSED_CAUSE, ModelEntry


def _ffn_kinds(entry: ModelEntry) -> str:
    parts = []
    if entry.dense_layers:
        parts.append(f"{entry.dense_layers} dense")
    if entry.moe_layers:
        parts.append(f"{entry.moe_layers} MoE")
    return " + ".join(parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def support_table_markdown() -> str:
    """One row per architecture: verified entries by family, then the refused ones."""
    lines = [
        "| Architecture | `model_type` | Family | FFN layers found | FFN over several ranks | Status |",
        "|---|---|---|---|---|---|",
    ]
    order = list(FAMILIES)
    for e in sorted(ENTRIES, key=lambda e: order.index(e.family)):
        status = "verified"
        if e.notes:
            status += f" ({e.notes})"
        if e.transformers:
            status += f"; transformers >= {e.transformers}"
        ranks = e.moe_split.upper() if e.moe_layers else "TP"
        if e.unshardable:
            ranks = f"{'no' if e.moe_layers else 'replicated only'}: {e.unshardable}"
        lines.append(
            f"| {_cell(e.name)} | `{e.model_type}` | {e.family} | {_ffn_kinds(e)} | {_cell(ranks)} | {_cell(status)} |"
        )
    for model_type, message in REFUSED.items():
        name = CONFIG_MAPPING_NAMES.get(model_type, model_type).removesuffix("Config")
        reason = f"refused: {message}; {REFUSED_CAUSE[model_type]}"
        lines.append(f"| {_cell(name)} | `{model_type}` | - | - | - | {_cell(reason)} |")
    verified, refused = len(ENTRIES), len(REFUSED)
    lines += ["", f"{verified} architectures verified, {refused} refused."]
    return "\n".join(lines)


def main() -> None:
    print(support_table_markdown())


if __name__ == "__main__":
    main()
