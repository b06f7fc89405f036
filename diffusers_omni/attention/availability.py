"""Availability means it runs: kernel packages are imported, not just found, before a backend is called available.

Two checks:

- **Selection time** (the selector, ``auto``, ``explain``): ``import_failure(name)`` imports the package in this
  process, catching any ``Exception`` (``ImportError: libc10_cuda.so ...``, ``OSError``, ``RuntimeError``), once
  per process. ``package_reason(name, hint)`` turns the result into the reason a backend shows: "not importable"
  (``find_spec`` finds nothing, nothing is imported) or "failed to import: <ExceptionType>: <message>".
- **Isolated** (``diffusers-omni info``): ``probe(tasks)`` runs the imports, and on a real GPU one tiny attention call
  per backend, in a child interpreter, so a package whose import kills the interpreter (a segfault, ``os.abort()``)
  cannot take the caller down; the task that was running when the child died is reported with its exit signal and
  the end of its output, and the tasks after it run in a fresh child. ``isolated_results(results)`` makes the
  selection-time check use those results instead of importing in this process.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

# name -> None (imports) or "ExceptionType: message". Filled on first use, or from an isolated probe.
_results: dict[str, str | None] = {}
# While ``isolated_results`` is active: names asked for that the probe did not cover (never imported here).
_isolated: set[str] | None = None

MAX_MESSAGE = 400
PROBE_TIMEOUT_S = 300.0


def _find(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except Exception:  # a parent package that fails to import, a malformed name
        return False


def _not_found(result: str | None, name: str) -> bool:
    """Whether an import result says ``name`` itself (or a parent package) does not exist, rather than that its
    import failed (a missing dependency of ``name`` is a failed import)."""
    prefix = "ModuleNotFoundError: No module named '"
    if result is None or not result.startswith(prefix):
        return False
    missing = result[len(prefix):].partition("'")[0]
    return name == missing or name.startswith(missing + ".")


def package_installed(name: str) -> bool:
    """True when ``name`` is found on the path, without importing it (``find_spec`` imports the parents of a dotted
    name; inside ``isolated_results`` only the top-level package is looked up here and the probe decides the rest)."""
    if _isolated is not None and "." in name:
        return _find(name.partition(".")[0]) and not _not_found(_results.get(name), name)
    return _find(name)


def _one_line(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 1] + "…"


def describe_exception(exc: BaseException) -> str:
    """``"ImportError: libc10_cuda.so: cannot open shared object file"``: type and message on one line."""
    message = _one_line(str(exc))
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def import_failure(name: str) -> str | None:
    """``None`` when ``name`` imports; otherwise ``"ExceptionType: message"``. Imports once per process.

    Inside ``isolated_results`` nothing is imported here: names the probe covered answer from it, and any other name
    answers ``None`` for now and is recorded, so that the caller can probe it too and ask again.
    """
    if name in _results:
        return _results[name]
    if _isolated is not None:
        _isolated.add(name)
        return None
    try:
        importlib.import_module(name)
    except Exception as exc:  # ImportError, OSError (a missing .so), RuntimeError (a CUDA mismatch), anything else
        _results[name] = describe_exception(exc)
    else:
        _results[name] = None
    return _results[name]


def package_reason(name: str, hint: str) -> str | None:
    """Why package ``name`` cannot serve a backend (``None``: it imports). ``hint`` says how to install it."""
    if not package_installed(name):
        return f"package {name!r} is not importable; to install: {hint}"
    failure = import_failure(name)
    if failure is not None:
        return f"package {name!r} failed to import: {failure}; to install: {hint}"
    return None


def package_importable(name: str) -> bool:
    """True when ``name`` is installed and imports in this process (imported once, failures caught)."""
    return package_installed(name) and import_failure(name) is None


def clear_import_cache() -> None:
    """Forget every import result (tests; a package installed while the process runs)."""
    _results.clear()


@contextlib.contextmanager
def isolated_results(results: dict[str, str | None]) -> Iterator[set[str]]:
    """Answer ``import_failure`` from ``results`` (an isolated probe's) and import nothing in this process.

    Yields the set of names asked for that ``results`` does not cover; probe those and enter again.
    """
    global _isolated
    saved, previous = dict(_results), _isolated
    _results.clear()
    _results.update(results)
    _isolated = set()
    try:
        yield _isolated
    finally:
        _isolated = previous
        _results.clear()
        _results.update(saved)


# Isolated probe: a child interpreter runs the tasks and appends one JSON line per task to a results file.
# ["import", module] imports a module; ["call", "module:Class", device, dtype] builds that backend class with no
# spec and runs one tiny attention call (batch 1, 256 tokens, 2 heads, head_dim 128), checking the output's shape
# and that it is finite.

def task_key(task: list) -> str:
    """The key ``probe`` files a task's result under."""
    return json.dumps(task)


def _run_task(task: list) -> str | None:
    if task[0] == "import":
        try:
            importlib.import_module(task[1])
        except Exception as exc:
            return describe_exception(exc)
        return None
    if task[0] == "call":
        import torch  # only here: an import task costs that import alone

        module_name, _, qualname = task[1].partition(":")
        device, dtype = torch.device(task[2]), getattr(torch, task[3])
        try:
            backend_cls = importlib.import_module(module_name)
            for part in qualname.split("."):
                backend_cls = getattr(backend_cls, part)
            backend = backend_cls(None)
            q, k, v = (torch.randn(1, 256, 2, 128, device=device, dtype=dtype) for _ in range(3))
            out = backend(q, k, v)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as exc:
            return f"a tiny attention call ([1, 256, 2, 128] {task[3]} on {task[2]}) failed: {describe_exception(exc)}"
        if tuple(out.shape) != tuple(q.shape) or not bool(torch.isfinite(out.float()).all()):
            return (f"a tiny attention call ([1, 256, 2, 128] {task[3]} on {task[2]}) returned "
                    f"{'shape ' + str(tuple(out.shape)) if tuple(out.shape) != tuple(q.shape) else 'non-finite values'}")
        return None
    raise ValueError(f"unknown probe task {task!r}")


def probe_child(results_path: str) -> None:
    request = json.loads(sys.stdin.read())
    with open(results_path, "a", encoding="utf-8") as out:
        for task in request["tasks"]:
            out.write(json.dumps({"start": task}) + "\n")
            out.flush()
            error = _run_task(task)
            out.write(json.dumps({"done": task, "error": error}) + "\n")
            out.flush()


def _death(returncode: int | None, stderr: str, timeout_s: float | None = None) -> str:
    if timeout_s is not None:
        how = f"did not finish within {timeout_s:g} s (stopped)"
    elif returncode is not None and returncode < 0:
        try:
            how = f"crashed the interpreter (killed by {signal.Signals(-returncode).name})"
        except ValueError:
            how = f"crashed the interpreter (killed by signal {-returncode})"
    else:
        how = f"ended the interpreter (exit status {returncode})"
    tail = _one_line(stderr.strip()[-300:]) if stderr and stderr.strip() else ""
    return f"{how}; its output ends: {tail!r}" if tail else how


# The child loads this file alone (not the diffusers_omni package, so an import task costs only that import).
_CHILD = (
    "import importlib.util, sys; "
    "spec = importlib.util.spec_from_file_location('diffusers_omni_probe', {source!r}); "
    "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
    "module.probe_child({results!r})"
)


def _read_results(path: str) -> tuple[dict[str, str | None], list | None]:
    """The finished tasks in a child's results file, and the task it started and has not finished (or ``None``)."""
    results, running = {}, None
    if os.path.exists(path):
        with open(path, encoding="utf-8") as lines:
            for line in lines:
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by the child's death or still being written
                if "start" in entry:
                    running = entry["start"]
                else:
                    results[task_key(entry["done"])] = entry["error"]
                    running = None
    return results, running


def probe(tasks: list[list], timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, str | None]:
    """Run ``tasks`` in child interpreters; ``{task key: None or the error}`` for every task (``task_key``).

    A child that dies (signal, exit) or spends more than ``timeout_s`` on one task fails the task it was running
    with how it died and the end of its output; the tasks after it run in a new child.
    """
    results: dict[str, str | None] = {}
    remaining = [list(t) for t in tasks]
    while remaining:
        with tempfile.TemporaryDirectory(prefix="omni-probe-") as folder:
            path = os.path.join(folder, "results.jsonl")
            command = [sys.executable, "-c", _CHILD.format(source=__file__, results=path)]
            # Output to files, not pipes: a chatty import cannot fill a pipe and block the child.
            with open(os.path.join(folder, "request.json"), "w+", encoding="utf-8") as request, \
                    open(os.path.join(folder, "output.txt"), "w+", encoding="utf-8", errors="replace") as output:
                request.write(json.dumps({"tasks": remaining}))
                request.seek(0)
                child = subprocess.Popen(command, stdin=request, stdout=output, stderr=subprocess.STDOUT)
                timed_out, seen, since = None, None, time.monotonic()
                while child.poll() is None:
                    time.sleep(0.05)
                    _, running = _read_results(path)
                    if running != seen:
                        seen, since = running, time.monotonic()
                    elif time.monotonic() - since > timeout_s:
                        child.kill()
                        child.wait()
                        timed_out = timeout_s
                returncode = child.returncode
                output.seek(0)
                stderr = output.read()
            found, running = _read_results(path)
        results.update(found)
        if running is None and all(task_key(t) in results for t in remaining):
            break
        culprit = running if running is not None else next(t for t in remaining if task_key(t) not in results)
        results[task_key(culprit)] = _death(returncode, stderr, timed_out)
        remaining = [t for t in remaining if task_key(t) not in results]
    return results


def probe_imports(modules: list[str] | tuple[str, ...], timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, str | None]:
    """``{module: None or "ExceptionType: message" or how the child died}``, imported in child interpreters."""
    modules = list(dict.fromkeys(modules))
    found = probe([["import", m] for m in modules], timeout_s=timeout_s)
    return {m: found[task_key(["import", m])] for m in modules}
