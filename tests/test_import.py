import subprocess
import sys

OPTIONAL_KERNEL_PACKAGES = ("flash_attn", "flash_attn_interface", "flashinfer", "sageattention", "sageattn3", "kernels", "mindiesd")


def test_import_is_light():
    """Importing the package loads no kernel package, no Diffusers and not even torch."""
    code = (
        "import sys, time; t = time.perf_counter(); import diffusers_omni; dt = time.perf_counter() - t; "
        "print(dt); print(' '.join(sorted(m for m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    elapsed, modules = float(out[0]), set(out[1].split())
    assert elapsed < 0.5, elapsed
    assert not modules & set(OPTIONAL_KERNEL_PACKAGES)
    assert "diffusers" not in modules and "torch" not in modules


def test_public_names_resolve():
    import diffusers_omni

    for name in diffusers_omni.__all__:
        assert getattr(diffusers_omni, name) is not None, name
