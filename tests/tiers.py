"""The suite's two tiers: the default run (CI's) checks each behaviour once; ``pytest --sweep``
also runs the cases marked ``sweep``, which repeat a behaviour on another model, plan or transport
(tests/conftest.py deselects them otherwise)."""

import pytest


def sweep(*values) -> pytest.ParameterSet:
    """A parametrization's case that only ``--sweep`` runs."""
    return pytest.param(*values, marks=pytest.mark.sweep)
