"""afdc's norm and gated-activation Triton kernels against their PyTorch references.

The launchers (``*_triton``) are called directly so a test proves the kernel ran, not the
fallback; on a machine without a GPU they run in Triton's interpreter, hence the tiny shapes.
"""

import pytest
import torch

from afdc.codegen.act_mul import act_mul_reference, act_mul_triton
from afdc.codegen.layer_norm import (
    add_layer_norm_reference,
    add_layer_norm_triton,
    layer_norm_reference,
    layer_norm_triton,
)
from afdc.codegen.rms_norm import (
    add_rms_norm_reference,
    add_rms_norm_triton,
    as_rows,
    rms_norm_reference,
    rms_norm_triton,
)

pytestmark = pytest.mark.usefixtures("triton_interpret")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]
# Shapes: no rows, one row, a hidden size that is not a power of two in 3-D, a power of two.
SHAPES = [(0, 48), (1, 48), (2, 3, 48), (4, 64)]


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEVICE).to(dtype)


def assert_close(actual, expected, *inputs):
    """fp32 matches to rounding; with bf16 in the output or ``inputs``, to about one bf16 ulp.

    The interpreter may round fp32 to bf16 differently from torch, and a bf16 residual sum that
    rounds differently shifts the normalized row by that much even in an fp32 output.
    """
    exact = all(t.dtype == torch.float32 for t in (expected, *inputs))
    tol = 1e-5 if exact else 2e-2
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# -- rms_norm ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("has_weight", "offset"), [(True, 0.0), (True, 1.0), (False, 0.0)])
def test_rms_norm_kernel(shape, dtype, has_weight, offset):
    x = randn(*shape, dtype=dtype)
    weight = randn(shape[-1], dtype=dtype) if has_weight else None
    out = rms_norm_triton(x, weight, 1e-6, offset, dtype)
    assert out.shape == x.shape
    assert_close(out, rms_norm_reference(x, weight, 1e-6, offset, dtype))


def test_rms_norm_kernel_row_strided_view_into_fp32():
    """A column slice is read in place through its row stride; a bf16 input may produce fp32."""
    base = randn(5, 96, dtype=torch.bfloat16)
    x = base[:, 8:56]
    assert as_rows(x).data_ptr() == x.data_ptr()
    weight = randn(48)
    out = rms_norm_triton(x, weight, 1e-5, 0.0, torch.float32)
    assert_close(out, rms_norm_reference(x, weight, 1e-5, 0.0, torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_add_rms_norm_kernel(shape, dtype):
    x, residual = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype)
    weight = randn(shape[-1])
    normed, summed = add_rms_norm_triton(x, residual, weight, 1e-6, 1.0, dtype)
    ref_normed, ref_summed = add_rms_norm_reference(x, residual, weight, 1e-6, 1.0, dtype)
    assert_close(summed, ref_summed)
    assert_close(normed, ref_normed)


def test_add_rms_norm_kernel_mixed_dtypes_and_strided_residual():
    """bf16 + fp32 sums in fp32, as torch's add promotes; the residual is read through its row stride."""
    x = randn(2, 3, 48, dtype=torch.bfloat16)
    residual = randn(2, 3, 64)[..., :48]
    normed, summed = add_rms_norm_triton(x, residual, None, 1e-6, 0.0, torch.bfloat16)
    ref_normed, ref_summed = add_rms_norm_reference(x, residual, None, 1e-6, 0.0, torch.bfloat16)
    assert summed.dtype == torch.float32
    assert_close(summed, ref_summed)
    assert_close(normed, ref_normed)


def test_norm_kernels_reject_mismatched_shapes():
    x = randn(2, 48)
    with pytest.raises(ValueError, match="weight has shape"):
        rms_norm_triton(x, randn(47), 1e-6, 0.0, torch.float32)
    with pytest.raises(ValueError, match="differ in shape"):
        add_layer_norm_triton(x, randn(1, 48), None, None, 1e-5, torch.float32)


# -- layer_norm ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("has_weight", "has_bias"), [(True, True), (True, False), (False, False)])
def test_layer_norm_kernel(shape, dtype, has_weight, has_bias):
    # An offset mean checks that the variance is taken about the mean, padding columns excluded.
    x = (randn(*shape) + 3.0).to(dtype)
    weight = randn(shape[-1], dtype=dtype) if has_weight else None
    bias = randn(shape[-1], dtype=dtype) if has_bias else None
    out = layer_norm_triton(x, weight, bias, 1e-5, dtype)
    assert_close(out, layer_norm_reference(x, weight, bias, 1e-5, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_add_layer_norm_kernel(shape, dtype):
    x, residual = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype)
    weight, bias = randn(shape[-1]), randn(shape[-1])
    normed, summed = add_layer_norm_triton(x, residual, weight, bias, 1e-5, torch.float32)
    ref_normed, ref_summed = add_layer_norm_reference(x, residual, weight, bias, 1e-5, torch.float32)
    assert_close(summed, ref_summed)
    assert_close(normed, ref_normed, x)


# -- act_mul -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("leading", [(0,), (1,), (2, 3)])
def test_act_mul_kernel_on_chunk_views(leading, activation, dtype):
    """gate and up are the halves of one gate-up projection, read in place through row stride 2I."""
    gate, up = randn(*leading, 2 * 48, dtype=dtype).chunk(2, dim=-1)
    if gate.numel():
        assert as_rows(gate).data_ptr() == gate.data_ptr()
        assert as_rows(up).data_ptr() == up.data_ptr()
    out = act_mul_triton(gate, up, activation)
    assert out.shape == gate.shape
    assert_close(out, act_mul_reference(gate, up, activation))


def test_act_mul_kernel_row_split_over_programs_and_mixed_dtypes():
    """A row wider than one block spans programs; a bf16 gate times an fp32 up gives fp32."""
    gate = randn(2, 1100, dtype=torch.bfloat16)
    up = randn(2, 1100)
    out = act_mul_triton(gate, up, "silu")
    assert out.dtype == torch.float32
    # Eager silu rounds the activation to bf16 before the product; the kernel keeps it in fp32.
    torch.testing.assert_close(out, act_mul_reference(gate, up, "silu"), atol=2e-2, rtol=2e-2)


def test_act_mul_rejects_unknown_activation():
    gate = randn(2, 8)
    with pytest.raises(ValueError, match="silu, gelu, gelu_tanh"):
        act_mul_triton(gate, gate, "relu")
    with pytest.raises(ValueError, match="silu, gelu, gelu_tanh"):
        torch.ops.afdc.act_mul(gate, gate, "relu")


# -- custom ops ----------------------------------------------------------------------------------


def test_custom_ops_match_references():
    x, residual = randn(2, 3, 48, dtype=torch.bfloat16), randn(2, 3, 48, dtype=torch.bfloat16)
    weight, bias = randn(48), randn(48)
    bf16 = torch.bfloat16
    assert_close(torch.ops.afdc.rms_norm(x, weight, 1e-6, 1.0, bf16), rms_norm_reference(x, weight, 1e-6, 1.0, bf16))
    for got, want in zip(
        torch.ops.afdc.add_rms_norm(x, residual, weight, 1e-6, 0.0, bf16),
        add_rms_norm_reference(x, residual, weight, 1e-6, 0.0, bf16),
    ):
        assert_close(got, want)
    assert_close(
        torch.ops.afdc.layer_norm(x, weight, bias, 1e-5, bf16), layer_norm_reference(x, weight, bias, 1e-5, bf16)
    )
    for got, want in zip(
        torch.ops.afdc.add_layer_norm(x, residual, weight, None, 1e-5, bf16),
        add_layer_norm_reference(x, residual, weight, None, 1e-5, bf16),
    ):
        assert_close(got, want)
    gate, up = x.chunk(2, dim=-1)
    assert_close(torch.ops.afdc.act_mul(gate, up, "gelu_tanh"), act_mul_reference(gate, up, "gelu_tanh"))


@pytest.mark.parametrize(
    ("op", "args"),
    [
        ("rms_norm", lambda x, w: (x, w, 1e-6, 1.0, torch.bfloat16)),
        ("add_rms_norm", lambda x, w: (x, x.flip(0), None, 1e-6, 0.0, torch.float32)),
        ("layer_norm", lambda x, w: (x, w, w, 1e-5, torch.float32)),
        ("add_layer_norm", lambda x, w: (x, x.flip(0), w, None, 1e-5, torch.bfloat16)),
        ("act_mul", lambda x, w: (*x.chunk(2, dim=-1), "silu")),
    ],
)
def test_custom_op_registration(op, args):
    """Schema, fake kernel and dispatch of each op agree with what it computes (torch.library.opcheck)."""
    x, weight = randn(3, 16), randn(16)
    torch.library.opcheck(getattr(torch.ops.afdc, op).default, args(x, weight))
