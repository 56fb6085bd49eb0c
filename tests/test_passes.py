"""Graph passes on small hand-made graphs."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from afdc import segment
from afdc.passes.aliasing import split_writes, storage_root, writes
from afdc.passes.index_bounds import index_bounds
from afdc.segment import IndexBound


def _graph_with_slice_write():
    def f(x, w):
        a = x.clone()
        a[:, :2].copy_(x[:, 2:4] @ w)
        return a * 2

    return make_fx(f)(torch.randn(3, 4), torch.randn(2, 2)).graph


def test_in_place_write_found_through_its_view():
    g = _graph_with_slice_write()
    (root, writers), = writes(g).items()
    assert root.target is torch.ops.aten.clone.default
    assert [w.target for w in writers] == [torch.ops.aten.copy_.default]
    assert storage_root(writers[0].args[0]) is root


def test_cut_may_send_the_written_value_but_not_split_the_write():
    g = _graph_with_slice_write()
    mm = next(n for n in g.nodes if n.target is torch.ops.aten.mm.default)
    copy = next(n for n in g.nodes if n.target is torch.ops.aten.copy_.default)
    assert split_writes(g, [mm]) == []  # the product crosses; write and readers stay together
    assert split_writes(g, [mm, copy]) == [copy]  # the write would land in the other program


def test_index_bounds_follow_an_integer_input_into_what_it_indexes():
    """An integer input's range is the size of each dimension it indexes, reached through views and
    casts, the smallest over its uses; an input indexed only after arithmetic, a float input and a
    boolean mask have none."""
    aten, g = torch.ops.aten, fx.Graph()

    def placeholder(node, shape, dtype=torch.float32):
        node.meta["val"] = torch.empty(shape, dtype=dtype, device="meta")
        return node

    table, rows = placeholder(segment.add_weight(g, 0), (10, 4)), placeholder(segment.add_weight(g, 1), (6, 3))
    x0, x1, x3 = (placeholder(segment.add_input(g, i), (5, 2), torch.int64) for i in (0, 1, 3))
    x2, mask = placeholder(segment.add_input(g, 2), (5, 2)), placeholder(segment.add_input(g, 4), (6,), torch.bool)
    call = g.call_function
    as_int32 = call(aten._to_copy.default, (call(aten.view.default, (x1, [5, 2])),), {"dtype": torch.int32})
    outs = [
        call(aten.embedding.default, (table, x0)),  # x0: 10 rows ...
        call(aten.index.Tensor, (rows, [None, call(aten.reshape.default, (x0, [-1]))])),  # ... and 3 columns
        call(aten.gather.default, (rows, 0, as_int32)),  # x1: 6 rows ...
        call(aten.one_hot.default, (call(aten.flatten.using_ints, (x1,)), 4)),  # ... and 4 classes
        call(aten.gather.default, (x2, 1, x1)),  # ... and 2 columns of x2 (a float input, gathered from)
        call(aten.index.Tensor, (table, [call(aten.add.Tensor, (x3, 1))])),  # x3 + 1: no longer x3's values
        call(aten.index.Tensor, (rows, [mask])),
    ]
    g.output(tuple(outs))
    assert index_bounds(g) == (IndexBound(0, 3), IndexBound(1, 2))
