"""A small max-flow / min-cut solver (Dinic) over string-or-object keyed nodes."""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Hashable

INF = float("inf")


class FlowGraph:
    def __init__(self) -> None:
        self._adj: dict[Hashable, list[list]] = {}

    def add_edge(self, u: Hashable, v: Hashable, cap: float) -> None:
        fwd = [v, cap, None]
        bwd = [u, 0.0, fwd]
        fwd[2] = bwd
        self._adj.setdefault(u, []).append(fwd)
        self._adj.setdefault(v, []).append(bwd)

    def _levels(self, s: Hashable) -> dict[Hashable, int]:
        level = {s: 0}
        queue = deque([s])
        while queue:
            u = queue.popleft()
            for v, cap, _ in self._adj.get(u, ()):
                if cap > 1e-12 and v not in level:
                    level[v] = level[u] + 1
                    queue.append(v)
        return level

    def _push(self, u, t, pushed: float, level, it) -> float:
        if u == t:
            return pushed
        edges = self._adj.get(u, [])
        while it[u] < len(edges):
            e = edges[it[u]]
            v, cap = e[0], e[1]
            if cap > 1e-12 and level.get(v, -1) == level[u] + 1:
                got = self._push(v, t, min(pushed, cap), level, it)
                if got > 0:
                    e[1] -= got
                    e[2][1] += got
                    return got
            it[u] += 1
        return 0.0

    def max_flow(self, s: Hashable, t: Hashable) -> float:
        # augmenting paths recurse once per node on the path
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, 4 * len(self._adj) + 100))
        try:
            return self._max_flow(s, t)
        finally:
            sys.setrecursionlimit(limit)

    def _max_flow(self, s: Hashable, t: Hashable) -> float:
        flow = 0.0
        while True:
            level = self._levels(s)
            if t not in level:
                return flow
            it = {u: 0 for u in self._adj}
            while True:
                got = self._push(s, t, INF, level, it)
                if got <= 0:
                    break
                if got == INF:
                    return INF
                flow += got

    def sink_side(self, t: Hashable) -> set[Hashable]:
        """After :meth:`max_flow`: the nodes that can still reach ``t`` (the smallest sink side)."""
        seen = {t}
        queue = deque([t])
        while queue:
            v = queue.popleft()
            for u, _, rev in self._adj.get(v, ()):
                # u -> v has residual capacity exactly when the reverse record's partner does
                if rev[1] > 1e-12 and u not in seen:
                    seen.add(u)
                    queue.append(u)
        return seen
