"""Availability means it runs: a kernel package that is found but fails to import makes its backend unavailable,
with the import error as the reason; an isolated probe survives a package whose import kills the interpreter."""

import os
import sys

import pytest
import torch

from diffusers_omni.attention import availability
from diffusers_omni.attention.availability import (
    clear_import_cache,
    import_failure,
    package_reason,
    probe,
    probe_imports,
    task_key,
)
from diffusers_omni.attention.backends.base import AttentionCall
from diffusers_omni.attention.platform import Platform
from diffusers_omni.attention.registry import get_backend_class
from diffusers_omni.attention.selector import BackendNotSupportedError, resolve

HOPPER = Platform("cuda", "simulated sm_90", (9, 0), 91900)
CALL = AttentionCall(device_type="cuda", dtype=torch.bfloat16, head_dim=128)
LIBC10 = "libc10_cuda.so: cannot open shared object file: No such file or directory"


def write_package(root, name: str, body: str) -> None:
    package = root / name
    package.mkdir()
    (package / "__init__.py").write_text(body)


@pytest.fixture
def fakes(tmp_path, monkeypatch):
    """A folder on sys.path (and PYTHONPATH, for child interpreters) with kernel packages that misbehave."""
    write_package(tmp_path, "omni_fake_raises", f"raise ImportError({LIBC10!r})\n")
    write_package(tmp_path, "omni_fake_oserror", "raise OSError('undefined symbol: _ZN3c104cuda9SetDeviceEi')\n")
    write_package(tmp_path, "omni_fake_abort", "import os\nos.abort()\n")
    write_package(tmp_path, "omni_fake_fine", "VALUE = 1\n")
    # The FA3 forward-only package of the issue: found, and its import fails on a missing CUDA runtime library.
    write_package(tmp_path, "fa3_fwd_interface", f"raise ImportError({LIBC10!r})\n")
    (tmp_path / "omni_fake_backends.py").write_text(
        "import os\n"
        "from diffusers_omni.attention.backends.base import AttentionBackend\n"
        "class LaunchFails(AttentionBackend):\n"
        "    name = 'FAKE_LAUNCH_FAILS'\n"
        "    def __call__(self, q, k, v, *args, **kwargs):\n"
        "        raise RuntimeError('CUDA error: no kernel image is available for execution on the device')\n"
        "class LaunchAborts(AttentionBackend):\n"
        "    name = 'FAKE_LAUNCH_ABORTS'\n"
        "    def __call__(self, q, k, v, *args, **kwargs):\n"
        "        os.abort()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    clear_import_cache()
    yield tmp_path
    clear_import_cache()
    for name in ("omni_fake_fine", "omni_fake_backends"):
        sys.modules.pop(name, None)


def test_a_package_that_fails_to_import_makes_its_backend_unavailable_with_the_error(fakes, monkeypatch):
    sage = get_backend_class("SAGE_ATTN")
    monkeypatch.setattr(sage, "packages", (("omni_fake_raises", "pip install fake-kernel"),))
    reasons = sage.availability_reasons(HOPPER)
    assert f"package 'omni_fake_raises' failed to import: ImportError: {LIBC10}; to install: pip install fake-kernel" \
        in reasons
    # An explicit selection refuses it with that reason; nothing fails later at the first denoising step.
    with pytest.raises(BackendNotSupportedError, match="omni_fake_raises' failed to import: ImportError: libc10"):
        resolve("SAGE_ATTN", "flux.joint", "self", CALL, HOPPER)


@pytest.mark.parametrize("module, expected", [
    ("omni_fake_oserror", "failed to import: OSError: undefined symbol: _ZN3c104cuda9SetDeviceEi; to install: x"),
    ("omni_fake_fine", None),
    ("omni_fake_not_installed_at_all", "package 'omni_fake_not_installed_at_all' is not importable; to install: x"),
])
def test_package_reasons(fakes, module, expected):
    reason = package_reason(module, "x")
    assert reason == expected if expected is None else expected in reason


def test_a_failed_import_is_tried_once_per_process(fakes):
    (fakes / "omni_fake_counted").mkdir()
    (fakes / "omni_fake_counted" / "__init__.py").write_text(
        f"open({str(fakes / 'count')!r}, 'a').write('x')\nraise RuntimeError('CUDA driver version is insufficient')\n"
    )
    for _ in range(3):
        assert import_failure("omni_fake_counted") == "RuntimeError: CUDA driver version is insufficient"
    assert (fakes / "count").read_text() == "x"


def test_flash_attn_with_a_broken_fa3_fwd_is_unavailable_with_its_import_error(fakes):
    """The issue's case: fa3-fwd found, its import fails; FLASH_ATTN was reported available on sm_90."""
    from diffusers_omni.attention.backends.flash import flash_attention_implementations

    assert "FA3-fwd" not in flash_attention_implementations()
    reasons = " ".join(get_backend_class("FLASH_ATTN").availability_reasons(HOPPER))
    assert f"FA3-fwd: module 'fa3_fwd_interface' failed to import: ImportError: {LIBC10}; to install: pip install " \
           "fa3-fwd" in reasons


def test_isolated_probe_survives_an_interpreter_killing_import(fakes):
    found = probe_imports(["omni_fake_fine", "omni_fake_abort", "omni_fake_raises", "omni_fake_absent"])
    assert found["omni_fake_fine"] is None
    assert found["omni_fake_abort"].startswith("crashed the interpreter (killed by SIGABRT)")
    assert found["omni_fake_raises"] == f"ImportError: {LIBC10}"  # run in a fresh child after the crash
    assert found["omni_fake_absent"] == "ModuleNotFoundError: No module named 'omni_fake_absent'"
    assert "omni_fake_abort" not in sys.modules  # nothing was imported in this process


def test_isolated_probe_reports_launch_errors_and_crashes(fakes):
    tasks = [["call", "diffusers_omni.attention.backends.sdpa:TorchSDPABackend", "cpu", "float32"],
             ["call", "omni_fake_backends:LaunchFails", "cpu", "float32"],
             ["call", "omni_fake_backends:LaunchAborts", "cpu", "float32"],
             ["call", "diffusers_omni.attention.backends.sdpa:TorchSDPABackend", "cpu", "bfloat16"]]
    found = [probe(tasks)[task_key(t)] for t in tasks]
    assert found[0] is None and found[3] is None
    assert found[1] == ("a tiny attention call ([1, 256, 2, 128] float32 on cpu) failed: RuntimeError: CUDA error: "
                        "no kernel image is available for execution on the device")
    assert found[2].startswith("crashed the interpreter (killed by SIGABRT)")


def test_isolated_results_import_nothing_here(fakes):
    with availability.isolated_results({"omni_fake_raises": "ImportError: from the child"}) as unprobed:
        assert import_failure("omni_fake_raises") == "ImportError: from the child"
        assert import_failure("omni_fake_abort") is None  # not probed yet: recorded, not imported
    assert unprobed == {"omni_fake_abort"}
    assert import_failure("omni_fake_raises") == f"ImportError: {LIBC10}"  # outside: the real, in-process check


def test_isolated_dotted_names_are_not_found_by_importing_their_parent(fakes):
    """find_spec('a.b') imports 'a': inside isolation only 'a' is looked up, the probe's result decides the rest."""
    missing = {"omni_fake_abort.cute": "ModuleNotFoundError: No module named 'omni_fake_abort.cute'"}
    with availability.isolated_results(missing):
        assert package_reason("omni_fake_abort.cute", "x") == "package 'omni_fake_abort.cute' is not importable; " \
                                                              "to install: x"
    dependency = {"omni_fake_abort.cute": "ModuleNotFoundError: No module named 'cutlass'"}
    with availability.isolated_results(dependency):
        assert package_reason("omni_fake_abort.cute", "x") == ("package 'omni_fake_abort.cute' failed to import: "
                                                               "ModuleNotFoundError: No module named 'cutlass'; to "
                                                               "install: x")
    with availability.isolated_results({}) as unprobed:
        assert package_reason("omni_fake_abort.cute", "x") is None  # not probed yet: recorded, nothing imported
        assert package_reason("omni_fake_nowhere.cute", "x").endswith("is not importable; to install: x")
    assert unprobed == {"omni_fake_abort.cute"} and "omni_fake_abort" not in sys.modules


def test_isolated_probe_stops_an_import_that_hangs(fakes):
    write_package(fakes, "omni_fake_hangs", "import time\nprint('loading kernels...', flush=True)\ntime.sleep(600)\n")
    found = probe_imports(["omni_fake_hangs", "omni_fake_fine"], timeout_s=3)
    assert found["omni_fake_hangs"] == "did not finish within 3 s (stopped); its output ends: 'loading kernels...'"
    assert found["omni_fake_fine"] is None
