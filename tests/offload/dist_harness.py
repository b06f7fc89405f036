"""Run a function on N gloo ranks in separate processes, with a hard deadline (a bug must not hang the suite).

Ranks are forked from a *fork server* (multiprocessing's ``forkserver``): a fresh interpreter started once per
test session, which imports torch/diffusers and the scenario modules (``PRELOAD``) and then only forks. A fork costs
milliseconds and the ranks still start with everything imported, but they never inherit the test process: its
threads (tqdm monitors, tokenizers and BLAS pools) and its heap. Forking the test process itself hung the 2-rank
suite in some full runs: a test that drops a pipeline with distributed offload still enabled leaves a destroyed
gloo group in cyclic garbage, its worker threads alive; a forked rank inherited that garbage without the threads,
and when the rank's garbage collector freed it, ``~ProcessGroupGloo`` joined thread handles whose stacks glibc had
meanwhile handed to the rank's own gloo threads, and waited for them forever (in both ranks: same heap, same
collection point). ``start_server`` starts the server early, so that its imports overlap other tests.

Each rank gets a free port's process group with a short collective timeout, runs ``fn(rank, world_size, *args)``
(``fn`` is pickled by reference: a module-level function) and writes its result (or the exception text) to a file;
ranks still alive at the deadline are killed. A rank that did not return is reported with what it was doing: the
steps it passed (``note``), every Python thread's stack (faulthandler, on SIGUSR1 from the parent), every native
thread's stack (gdb, where installed) and the tail of its output.
"""

from __future__ import annotations

import atexit
import faulthandler
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch


# Imported once by the fork server (from the test process's sys.path); a rank imports anything else itself.
PRELOAD = ["torch", "torch.distributed", "diffusers", "diffusers_omni", "dist_scenarios", "quant_helpers"]
_server_log: Path | None = None


def start_server() -> None:
    """Start the fork server now, without waiting for its imports (the first ``launch`` waits for them). Its output
    goes to a log file (removed at exit), not to the terminal; each rank's own output goes to a file of its
    launch. Idempotent; a server that died is started again."""
    global _server_log
    from multiprocessing import forkserver

    if _server_log is not None:
        forkserver.ensure_running()
        return
    fd, name = tempfile.mkstemp(prefix="dist_harness_forkserver.", suffix=".log")
    os.close(fd)
    _server_log = Path(name)
    atexit.register(_server_log.unlink, missing_ok=True)
    forkserver.set_forkserver_preload(PRELOAD)
    # The server inherits this process's environment and fds 0-2 at its start. Python 3.11's fork server does not
    # apply the sys.path it is given before preloading, so it gets ours through PYTHONPATH (pytest's own entries,
    # such as this folder and the repository root, included).
    saved_path = os.environ.get("PYTHONPATH")
    saved_fds = os.dup(1), os.dup(2)
    try:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        with open(_server_log, "ab") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            forkserver.ensure_running()
    finally:
        os.dup2(saved_fds[0], 1)
        os.dup2(saved_fds[1], 2)
        os.close(saved_fds[0])
        os.close(saved_fds[1])
        if saved_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved_path


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


def _worker(fn: Callable, rank: int, world_size: int, port: int, out: str, args: tuple, pg_timeout: float,
            environ: dict[str, str]) -> None:
    import torch.distributed as dist

    global _NOTES, _STARTED
    _NOTES, _STARTED = Path(out) / f"rank{rank}.notes", time.monotonic()
    output = os.open(Path(out) / f"rank{rank}.output", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(output, 1)
    os.dup2(output, 2)
    stacks = open(Path(out) / f"rank{rank}.stacks", "w")  # noqa: SIM115 - open until os._exit
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    note(f"started (pid {os.getpid()})")

    os.environ.clear()  # the test process's environment at launch, not the fork server's at its start
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
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
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def launch(fn: Callable, world_size: int, *args: Any, deadline: float = 120.0, pg_timeout: float = 30.0) -> list:
    """Per rank: ``{"ok": True, "value": ...}``, ``{"ok": False, "error": ...}`` or ``{"ok": False, "exitcode": ..}``
    (the rank died or was killed at the deadline)."""
    start_server()
    context = multiprocessing.get_context("forkserver")
    port = free_port()
    parent_threads = [f"{t.name} (daemon={t.daemon})" for t in threading.enumerate()]
    environ = dict(os.environ)
    with tempfile.TemporaryDirectory() as out:
        processes = [
            context.Process(target=_worker, args=(fn, rank, world_size, port, out, args, pg_timeout, environ),
                            daemon=True)
            for rank in range(world_size)
        ]
        try:
            for process in processes:
                process.start()
        except Exception as error:
            log = _read(_server_log)[-4000:] if _server_log is not None else ""
            raise RuntimeError(f"the fork server could not start a rank; its output:\n{log}") from error
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
                    output=_read(Path(out) / f"rank{rank}.output")[-4000:], parent_threads_at_launch=parent_threads,
                )
        return results


def describe(rank: int, result: dict) -> str:
    """A failed rank's result as readable text (for assertion messages)."""
    lines = [f"rank {rank}: " + ", ".join(f"{k}={result[k]!r}" for k in ("ok", "exitcode", "error", "killed_at_deadline")
                                          if k in result)]
    for key in ("traceback", "notes", "python_stacks", "native_stacks", "output"):
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
