"""The ``afdc`` command line."""

from __future__ import annotations

import json
import sys

import click

import afdc
from afdc.errors import AfdcError


@click.group()
@click.version_option(afdc.__version__, prog_name="afdc")
def main() -> None:
    """afdc: automatic Attention-FFN Disaggregation for Hugging Face decoder models."""


@main.command()
@click.argument("model", required=False)
@click.option("--demo", is_flag=True, help="Use the built-in tiny random MoE model (no downloads).")
@click.option("--plan", default="1A1F", show_default=True, help="Deployment plan xAyF.")
@click.option("--router", type=click.Choice(["ffn", "attn"]), default="ffn", show_default=True,
              help="Which side runs the MoE router.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def inspect(model: str | None, demo: bool, plan: str, router: str, as_json: bool) -> None:
    """Split MODEL (hub id, model directory or config.json) and print what crosses the cut.

    MODEL is built on the meta device: no weights are read. With --demo a tiny random MoE model
    is built and the disaggregated model is also checked against it.
    """
    if demo == (model is not None):
        raise click.UsageError("give either MODEL or --demo")
    try:
        if demo:
            _inspect_demo(plan, router, as_json)
        else:
            from afdc.source import empty_model, load_config

            dm = afdc.disaggregate(empty_model(load_config(model)), plan=plan, router=router)
            dm.report().model = model
            click.echo(dm.report().to_json() if as_json else str(dm.report()))
    except AfdcError as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(2)


def _inspect_demo(plan: str, router: str, as_json: bool) -> None:
    from afdc.demo import demo_batch, demo_model
    from afdc.equivalence import check

    model = demo_model()
    dm = afdc.disaggregate(model, plan=plan, router=router)
    result = check(model, dm, *demo_batch(model.config.vocab_size))
    if as_json:
        click.echo(json.dumps({"report": dm.report().to_dict(), "equivalence": vars(result)}, indent=2))
    else:
        click.echo(str(dm.report()))
        click.echo("")
        click.echo(str(result))
    if not result.ok():
        sys.exit(1)
