"""``diffusers-omni info`` imports every kernel package in a child interpreter: a package that raises on import makes
its backend unavailable with the error, and one that kills the interpreter (os.abort) cannot take ``info`` down."""

import json
import os

import pytest

from diffusers_omni.attention.availability import clear_import_cache
from diffusers_omni.attention.registry import get_backend_class
from diffusers_omni.cli.info import format_info
from diffusers_omni.cli.main import main

LIBC10 = "libc10_cuda.so: cannot open shared object file: No such file or directory"


@pytest.fixture
def broken_kernels(tmp_path, monkeypatch):
    """SAGE_ATTN needs a package whose import aborts the interpreter; FLASHINFER_ATTN one whose import raises."""
    for name, body in [("omni_fake_info_abort", "import os\nos.abort()\n"),
                       ("omni_fake_info_raises", f"raise ImportError({LIBC10!r})\n")]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.setattr(get_backend_class("SAGE_ATTN"), "packages", (("omni_fake_info_abort", "pip install a"),))
    monkeypatch.setattr(get_backend_class("FLASHINFER_ATTN"), "packages", (("omni_fake_info_raises", "pip install b"),))
    # A dotted name: finding it (find_spec) imports its parent package, which must not happen in info's process.
    monkeypatch.setattr(get_backend_class("SAGE_ATTN_3"), "packages", (("omni_fake_info_abort.sub", "pip install c"),))
    clear_import_cache()
    yield
    clear_import_cache()


def test_info_reports_import_errors_and_survives_a_crashing_import(broken_kernels, capsys):
    assert main(["info", "--platform", "sm_90", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    backends = {b["name"]: b for b in info["backends"]}
    sage, flashinfer = backends["SAGE_ATTN"], backends["FLASHINFER_ATTN"]
    assert sage["available"] is False and flashinfer["available"] is False
    assert any(r.startswith("package 'omni_fake_info_abort' failed to import: crashed the interpreter (killed by "
                            "SIGABRT)") and r.endswith("; to install: pip install a") for r in sage["reasons"])
    assert (f"package 'omni_fake_info_raises' failed to import: ImportError: {LIBC10}; to install: pip install b"
            in flashinfer["reasons"])
    assert any(r.startswith("package 'omni_fake_info_abort.sub' failed to import: crashed the interpreter (killed by "
                            "SIGABRT)") for r in backends["SAGE_ATTN_3"]["reasons"])
    assert backends["TORCH_SDPA"]["available"] is True
    # A simulated platform cannot launch kernels: import results only, and the output says so.
    check = info["availability_check"]
    assert check["launch"] == "not run: a simulated platform cannot launch kernels; import results only"
    assert check["kernel_imports"]["omni_fake_info_raises"] == f"ImportError: {LIBC10}"
    assert all(b["launch"] is None for b in info["backends"])
    text = format_info(info)
    assert "kernel launch check: not run: a simulated platform cannot launch kernels; import results only" in text
    assert f"      - package 'omni_fake_info_raises' failed to import: ImportError: {LIBC10}" in text


def test_info_on_this_cpu_launches_nothing_and_says_why(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["availability_check"]["launch"] == "not run: the platform is cpu, not a CUDA GPU"
    assert info["environment_backend"] == {"backend": None, "source": None}


def test_info_shows_the_default_the_environment_asks_for(monkeypatch, capsys):
    monkeypatch.setenv("DIFFUSERS_ATTN_BACKEND", "native")
    assert main(["info", "--platform", "sm_90"]) == 0
    assert "default from the environment: TORCH_SDPA (environment variable DIFFUSERS_ATTN_BACKEND)" in \
        capsys.readouterr().out


def test_launch_checks_run_one_tiny_call_per_available_backend(tmp_path, monkeypatch):
    """What ``info`` runs on a CUDA GPU, here on the CPU: a launch error is reported, a Hub kernel is not fetched."""
    from diffusers_omni.attention.registry import register_backend, reset_backend
    from diffusers_omni.cli.info import launch_checks

    (tmp_path / "omni_fake_launch.py").write_text(
        "from diffusers_omni.attention.backends.base import AttentionBackend\n"
        "class NoKernelImage(AttentionBackend):\n"
        "    name = 'FAKE_NO_KERNEL_IMAGE'\n"
        "    def __call__(self, q, k, v, *args, **kwargs):\n"
        "        raise RuntimeError('CUDA error: no kernel image is available for execution on the device')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    register_backend("FAKE_NO_KERNEL_IMAGE", "omni_fake_launch:NoKernelImage")
    try:
        found = launch_checks({"TORCH_SDPA": [], "FAKE_NO_KERNEL_IMAGE": [], "FLASH_ATTN_HUB": [],
                               "SAGE_ATTN": ["package 'sageattention' is not importable"]}, device="cpu")
    finally:
        reset_backend("FAKE_NO_KERNEL_IMAGE")
    assert found == {
        "TORCH_SDPA": None,
        "FAKE_NO_KERNEL_IMAGE": "a tiny attention call ([1, 256, 2, 128] bfloat16 on cpu) failed: RuntimeError: CUDA "
                                "error: no kernel image is available for execution on the device",
        "FLASH_ATTN_HUB": "not run: its kernel is fetched from the Hub on first use",
    }
