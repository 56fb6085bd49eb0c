"""Graph passes on small hand-made graphs."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from afdc.passes.aliasing import split_writes, storage_root, writes


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
