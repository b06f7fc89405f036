"""Run a function on N gloo ranks in forked processes, with a hard deadline (a bug must not hang the suite).

Forking reuses the already imported torch/diffusers (a fresh interpreter takes ~20 s on a busy CI box). Each
rank gets a free port's process group with a short collective timeout, runs ``fn(rank, world_size, *args)`` and
writes its result (or the exception text) to a file; ranks still alive at the deadline are killed.

A rank killed at the deadline is reported with what it was doing: the steps it passed (``note``), every Python
thread's stack (faulthandler, on SIGUSR1 from the parent) and, where gdb is installed, every native thread's stack.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
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


_NOTES: Path | None = None
_STARTED = 0.0


def note(what: str) -> None:
    """Record a step of this rank (shown if the rank is killed at the deadline); a no-op outside a worker."""
    if _NOTES is not None:
        with open(_NOTES, "a") as file:
            file.write(f"{time.monotonic() - _STARTED:8.2f}s {what}\n")


def _worker(fn: Callable, rank: int, world_size: int, port: int, out: str, args: tuple, pg_timeout: float) -> None:
    import torch.distributed as dist

    global _NOTES, _STARTED
    _NOTES, _STARTED = Path(out) / f"rank{rank}.notes", time.monotonic()
    stacks = open(Path(out) / f"rank{rank}.stacks", "w")  # noqa: SIM115 - open until os._exit
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    note(f"forked (pid {os.getpid()}); threads copied from the parent are gone")

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    result: dict[str, Any]
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout))
        note("process group initialised")
        result = {"ok": True, "value": fn(rank, world_size, *args)}
        note("returned")
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
    parent_threads = [f"{t.name} (daemon={t.daemon})" for t in threading.enumerate()]
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
        hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
        native = {rank: _native_stacks(processes[rank].pid) for rank in hung}
        for rank in hung:
            os.kill(processes[rank].pid, signal.SIGUSR1)  # faulthandler: every Python thread's stack
        time.sleep(1.0 if hung else 0.0)
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
            if not results[-1]["ok"]:
                results[-1].update(
                    killed_at_deadline=rank in hung, notes=_read(Path(out) / f"rank{rank}.notes"),
                    python_stacks=_read(Path(out) / f"rank{rank}.stacks"), native_stacks=native.get(rank, ""),
                    parent_threads_at_launch=parent_threads,
                )
        return results


def describe(rank: int, result: dict) -> str:
    """A failed rank's result as readable text (for assertion messages)."""
    lines = [f"rank {rank}: " + ", ".join(f"{k}={result[k]!r}" for k in ("ok", "exitcode", "error", "killed_at_deadline")
                                          if k in result)]
    for key in ("traceback", "notes", "python_stacks", "native_stacks"):
        if result.get(key):
            lines += [f"--- {key} ---", result[key].rstrip()]
    if "parent_threads_at_launch" in result:
        lines.append(f"--- parent threads at launch: {result['parent_threads_at_launch']}")
    return "\n".join(lines)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _native_stacks(pid: int) -> str:
    """Every native thread's backtrace of a live process (gdb), or why there is none."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return "(gdb not installed)"
    try:
        done = subprocess.run([gdb, "-p", str(pid), "-batch", "-nx", "-ex", "thread apply all bt 30"],
                              capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "(gdb timed out)"
    return "\n".join(line for line in done.stdout.splitlines() if line.startswith(("#", "Thread")))
