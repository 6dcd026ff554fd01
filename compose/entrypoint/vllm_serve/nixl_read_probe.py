#!/usr/bin/env python3
"""One NIXL READ between two processes, as decode pulls KV from prefill, with UCX's protocol
tables captured: which transport UCX picked for the pull, and the GB/s it reached.

Why: the KV pull can silently run over TCP on a GPU host (docs/gpu.md, "KV transport"). The
servers' entrypoint reads UCX's tables as vLLM runs; this probe shows the same choice without a
model, on any host with nixl and torch (inside the vLLM image on a GPU host, in the kit's venv on
CPU), so the table format the entrypoint parses is the one this UCX prints.

    python3 compose/entrypoint/vllm_serve/nixl_read_probe.py --device cuda --mib 256 --log ucx.txt

Prints one JSON line (transfer times, GB/s, the data checked) and leaves UCX's output in --log
(the reading side, decode's) and --log.target (the side read from).
The environment is passed through: set UCX_TLS, UCX_CUDA_IPC_ENABLE_GET_ZCOPY, UCX_MODULE_DIR
as the server would. Standard library, torch and nixl only.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

STATE_TIMEOUT_S = 60.0


def _agent(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def _tensor(device: str, nbytes: int, fill: int | None) -> Any:
    import torch

    if fill is None:
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    gen = torch.arange(nbytes, dtype=torch.int64, device=device)
    return ((gen * 131 + fill) % 251).to(torch.uint8)


def _stdout_to(path: str) -> None:
    """UCX prints its tables to fd 1: send them to ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.close(fd)


def target(conn: Connection, device: str, nbytes: int, log: str) -> None:
    """Prefill's side: registers its buffer, hands over its metadata, waits for the reads."""
    _stdout_to(log)
    agent = _agent("probe-target")
    src = _tensor(device, nbytes, fill=7)
    agent.register_memory(src)
    descs = agent.get_xfer_descs(src)
    conn.send((agent.get_agent_metadata(), agent.get_serialized_descs(descs), int(src.sum())))
    conn.recv()  # the initiator is done reading


def initiator(conn: Connection, device: str, nbytes: int, iters: int, log: str) -> None:
    """Decode's side: UCX's stdout goes to ``log``; READs the target's buffer ``iters`` times."""
    _stdout_to(log)
    meta, serialized, want = conn.recv()
    agent = _agent("probe-initiator")
    dst = _tensor(device, nbytes, fill=None)
    agent.register_memory(dst)
    remote = agent.add_remote_agent(meta)
    remote_descs = agent.deserialize_descs(serialized)
    local_descs = agent.get_xfer_descs(dst)
    seconds: list[float] = []
    error = ""
    for _ in range(iters):
        handle = agent.initialize_xfer("READ", local_descs, remote_descs, remote, b"")
        start = time.perf_counter()
        state = agent.transfer(handle)
        deadline = start + STATE_TIMEOUT_S
        while state not in ("DONE", "ERR") and time.perf_counter() < deadline:
            state = agent.check_xfer_state(handle)
        elapsed = time.perf_counter() - start
        agent.release_xfer_handle(handle)
        if state != "DONE":
            error = f"transfer ended {state!r}"
            break
        seconds.append(elapsed)
    got = int(dst.sum())
    sys.stdout.flush()
    conn.send({"seconds": seconds, "error": error, "checksum_ok": got == want})


def _answer(conn: Connection, proc: Any, timeout_s: float) -> bool:
    """Whether ``proc`` answered on ``conn`` within ``timeout_s``; False at once when it died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if conn.poll(0.2):
            return True
        if not proc.is_alive():
            return conn.poll(0)
    return False


def probe(device: str, nbytes: int, iters: int, log: str) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    t_conn, t_child = ctx.Pipe()
    i_conn, i_child = ctx.Pipe()
    t = ctx.Process(target=target, args=(t_child, device, nbytes, f"{log}.target"), daemon=True)
    i = ctx.Process(target=initiator, args=(i_child, device, nbytes, iters, log), daemon=True)
    t.start()
    i.start()
    try:
        if not _answer(t_conn, t, STATE_TIMEOUT_S):
            raise RuntimeError(f"the target agent did not start (exit {t.exitcode})")
        i_conn.send(t_conn.recv())
        if not _answer(i_conn, i, STATE_TIMEOUT_S + 30 * iters):
            raise RuntimeError(f"the initiator did not finish (exit {i.exitcode})")
        result: dict[str, Any] = i_conn.recv()
        t_conn.send("done")
    finally:
        for proc in (i, t):
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    secs = result["seconds"]
    warm = secs[1:] or secs
    med = statistics.median(warm) if warm else float("nan")
    return {
        "device": device,
        "mib": nbytes >> 20,
        "iters": iters,
        "first_s": secs[0] if secs else None,
        "median_s": med,
        "gb_per_s": nbytes / med / 1e9 if warm else None,
        "checksum_ok": result["checksum_ok"],
        "error": result["error"],
        "ucx_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    ap.add_argument("--mib", type=int, default=64, help="bytes read per transfer, MiB")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--log", required=True, help="file for UCX's output (its protocol tables)")
    args = ap.parse_args(argv)
    if args.mib <= 0 or args.iters <= 0:
        ap.error("--mib and --iters must be positive")
    os.environ.setdefault("UCX_PROTO_INFO", "y")
    out = probe(args.device, args.mib << 20, args.iters, args.log)
    print(json.dumps(out), flush=True)
    return 0 if out["checksum_ok"] and not out["error"] else 1


if __name__ == "__main__":
    sys.exit(main())
