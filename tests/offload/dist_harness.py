"""Run a function on N gloo ranks in forked processes, with a hard deadline (a bug must not hang the suite).

Forking reuses the already imported torch/diffusers (a fresh interpreter takes ~20 s on a busy CI box). Each
rank gets a free port's process group with a short collective timeout, runs ``fn(rank, world_size, *args)`` and
writes its result (or the exception text) to a file; ranks still alive at the deadline are killed.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(fn: Callable, rank: int, world_size: int, port: int, out: str, args: tuple, pg_timeout: float) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    result: dict[str, Any]
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout))
        result = {"ok": True, "value": fn(rank, world_size, *args)}
    except BaseException as error:  # noqa: BLE001 - reported to the test
        result = {"ok": False, "error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    torch.save(result, Path(out) / f"rank{rank}.pt")
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        os._exit(0)


def launch(fn: Callable, world_size: int, *args: Any, deadline: float = 120.0, pg_timeout: float = 30.0) -> list:
    """Per rank: ``{"ok": True, "value": ...}``, ``{"ok": False, "error": ...}`` or ``{"ok": False, "exitcode": ..}``
    (the rank died or was killed at the deadline)."""
    context = multiprocessing.get_context("fork")
    port = free_port()
    with tempfile.TemporaryDirectory() as out:
        processes = [
            context.Process(target=_worker, args=(fn, rank, world_size, port, out, args, pg_timeout), daemon=True)
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        end = time.monotonic() + deadline
        for process in processes:
            process.join(max(end - time.monotonic(), 0.1))
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(5)
        results = []
        for rank, process in enumerate(processes):
            path = Path(out) / f"rank{rank}.pt"
            if path.exists():
                results.append(torch.load(path, weights_only=False))
            else:
                results.append({"ok": False, "exitcode": process.exitcode})
        return results
