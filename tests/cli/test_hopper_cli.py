"""``diffusers-omni warmup`` input checks, and ``explain`` flagging lossy roles (issue 15)."""

import torch

from diffusers_omni.attention.backends.sdpa import TorchSDPABackend
from diffusers_omni.attention.registry import register_backend, reset_backend
from diffusers_omni.cli.main import main


def test_warmup_checks_its_input_and_needs_cuda(capsys):
    assert main(["warmup", "--head-dims", "65"]) == 2
    assert "--head-dims='65': [65] not allowed; allowed: 64, 128, 256" in capsys.readouterr().err
    assert main(["warmup", "--dtypes", "float32"]) == 2
    assert "['float32'] not allowed; allowed: bfloat16, float16" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["warmup"]) == 2
        assert "no CUDA device here (warmup compiles CUDA kernels)" in capsys.readouterr().err


class LossyTest(TorchSDPABackend):
    name = "LOSSY_TEST"
    lossy = True


def test_explain_marks_lossy_roles(capsys):
    register_backend("LOSSY_TEST", LossyTest)
    try:
        assert main(["explain", "--model", "tiny-wan", "--attention", '{"per_role": {"wan.self": "LOSSY_TEST"}}']) == 0
    finally:
        reset_backend("LOSSY_TEST")
    out = capsys.readouterr().out
    assert "wan.self: LOSSY" in out and "diffusers-omni compare" in out
    assert "wan.cross: LOSSY" not in out
