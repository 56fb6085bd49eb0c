"""Attention ranks as vLLM's data-parallel ranks.

One ``vllm serve --data-parallel-size A`` runs a plan's A attention ranks: vLLM's API servers,
its DP coordinator (load balancing) and one engine core per DP rank, in which afdc's worker
takes its attention rank from vLLM's global DP rank. Further hosts run more of them with
``--data-parallel-size-local N --data-parallel-start-rank R --headless``. This module reads
those of vLLM's arguments that afdc must agree with, before vLLM starts.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from afdc.errors import AfdcError


@dataclass(frozen=True)
class DataParallel:
    """The DP ranks one ``vllm serve`` process runs: ``start .. start + local - 1`` of ``size``."""

    size: int | None  # --data-parallel-size; None: not given
    local: int | None  # --data-parallel-size-local; None: all of them
    start: int  # --data-parallel-start-rank
    headless: bool  # engines only, no API server (a further node)

    @classmethod
    def of(cls, vllm_args: Sequence[str]) -> DataParallel:
        """Parse vLLM's own spellings (long, short, ``--x=v``) of the DP arguments; others are ignored."""
        p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        p.add_argument("--data-parallel-size", "-dp", type=int)
        p.add_argument("--data-parallel-size-local", "-dpl", type=int)
        p.add_argument("--data-parallel-start-rank", "-dpr", type=int, default=0)
        p.add_argument("--data-parallel-rank", "-dpn", type=int)
        p.add_argument("--headless", action="store_true")
        try:
            args, _ = p.parse_known_args(list(vllm_args))
        except SystemExit as err:  # argparse exits on a malformed value
            raise AfdcError(f"cannot read the data-parallel arguments in {' '.join(vllm_args)}") from err
        if args.data_parallel_rank is not None:
            raise AfdcError(
                "--data-parallel-rank (vLLM's external load balancing: one API server per DP rank) is not how afdc "
                "runs attention ranks: give --data-parallel-size A on the first host, and --data-parallel-size-local "
                "N --data-parallel-start-rank R --headless on further hosts"
            )
        return cls(args.data_parallel_size, args.data_parallel_size_local, args.data_parallel_start_rank,
                   args.headless)

    def checked(self, attention_ranks: int) -> DataParallel:
        """This process's DP ranks, the plan's attention ranks: equal sizes, ranks within the plan."""
        size = self.size if self.size is not None else attention_ranks
        if size != attention_ranks:
            raise AfdcError(
                f"the plan has {attention_ranks} attention ranks but vLLM was given --data-parallel-size {size}: "
                f"each attention rank is one vLLM DP rank; give --data-parallel-size {attention_ranks} (or compile "
                f"the artifact for {size} attention ranks)"
            )
        local = self.local if self.local is not None else size - self.start
        if self.start < 0 or local < 1 or self.start + local > size:
            raise AfdcError(
                f"DP ranks {self.start}..{self.start + local - 1} (--data-parallel-start-rank {self.start}, "
                f"--data-parallel-size-local {local}) are not all within the plan's attention ranks 0..{size - 1}"
            )
        if self.headless and self.start == 0:
            raise AfdcError("--headless runs DP ranks of a further host: give it --data-parallel-start-rank R > 0")
        return DataParallel(size, local, self.start, self.headless)

    @property
    def hosts_rank_zero(self) -> bool:
        """Whether attention rank 0 (which hosts the deployment's rendezvous store) runs here."""
        return self.start == 0

    def args(self, vllm_args: Sequence[str]) -> list[str]:
        """``vllm_args`` with this ``--data-parallel-size`` added when they do not give one (A > 1)."""
        if self.size in (None, 1) or DataParallel.of(vllm_args).size is not None:
            return list(vllm_args)
        return ["--data-parallel-size", str(self.size), *vllm_args]
