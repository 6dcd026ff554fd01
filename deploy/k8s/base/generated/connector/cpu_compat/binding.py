"""One OpenMP core group per rank for vLLM's CPU workers (``VLLM_CPU_OMP_THREADS_BIND``).

A PCP2 prefill runs two worker processes; vLLM binds rank ``r`` to the ``r``-th ``|``-separated
group. The kit's knobs name a server's cores once (``PREFILL_CPUS=0,1``, also the container's
cpuset), and this splits them evenly: ``0,1`` for two ranks -> ``0|1``. Standard library only:
the containers' entrypoint calls it before vLLM is imported.
"""

from __future__ import annotations

from collections.abc import Sequence


def parse_cpu_list(text: str) -> list[int]:
    """``"0,1"``, ``"0-3"``, ``"0-1,4"`` (Linux cpuset syntax) -> sorted core ids, no repeats."""
    cores: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        first, sep, last = part.partition("-")
        if not first.isdigit() or (sep and not last.isdigit()):
            raise ValueError(f"{text!r}: not a CPU list like 0,1 or 0-3")
        low, high = int(first), int(last) if sep else int(first)
        if high < low:
            raise ValueError(f"{text!r}: range {part} runs backwards")
        cores.update(range(low, high + 1))
    if not cores:
        raise ValueError(f"{text!r}: no CPUs")
    return sorted(cores)


def omp_threads_bind(cores: Sequence[int], ranks: int) -> str:
    """One core group per rank, ``|``-separated (vLLM's per-rank syntax).

    More cores than ranks: equal groups of consecutive cores (``0,1,2,3`` over 2 -> ``0,1|2,3``).
    Fewer: the ranks take turns on them (``0`` over 2 -> ``0|0``), which keeps a PCP prefill off
    the decode's core on a small machine: each rank's thread then sleeps while the other works.
    """
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    count = len(cores)
    if count >= ranks and count % ranks == 0:
        size = count // ranks
        groups = [list(cores[i * size : (i + 1) * size]) for i in range(ranks)]
    elif count and ranks % count == 0:
        groups = [[cores[i % count]] for i in range(ranks)]
    else:
        raise ValueError(
            f"{count} CPU(s) {list(cores)} cannot be split evenly over {ranks} rank(s): "
            f"give a multiple or a divisor of {ranks}"
        )
    return "|".join(",".join(str(core) for core in group) for group in groups)
