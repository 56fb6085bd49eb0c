import os
import sys

import pytest
import torch

# Triton wraps its own library functions (tl.sum, tl.max, ...) for the interpreter only when
# TRITON_INTERPRET is set at its import, so it is set before anything imports triton: afdc's
# kernels then run in the interpreter on this CPU-only test machine.
if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the vLLM engines the tests start send no usage report (each would collect the host's details in
# a thread, about a CPU-second with the subprocess that reads the CPU's, then try the network)
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


@pytest.fixture
def triton_interpret():
    """Run afdc's Triton kernels: on the GPU when there is one, else in Triton's interpreter."""
    pytest.importorskip("triton", reason="Triton is not installed (pip install -e '.[kernels]')")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("TRITON_INTERPRET=1 must be set before triton is imported (tests/conftest.py does it)")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--sweep", action="store_true", default=False,
        help="also run the cases marked `sweep`: every catalog entry and every combination of the wide "
             "parametrizations (the default run, CI's, checks each behaviour once)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without ``--sweep``, the cases marked ``sweep`` are deselected: each repeats, on another
    model, plan or transport, what a case that stays already checks, and together they would
    double CI's time. Tests marked ``slow`` run first, each module's in its order (its fixtures
    stay shared): under ``-n 2 --dist worksteal`` the workers then end the run on short tests, not
    one idle while the other finishes a server test it took last."""
    if not config.getoption("--sweep"):
        swept = [item for item in items if item.get_closest_marker("sweep") is not None]
        if swept:
            config.hook.pytest_deselected(items=swept)
            items[:] = [item for item in items if item.get_closest_marker("sweep") is None]
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)

