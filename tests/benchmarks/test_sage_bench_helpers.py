"""CPU checks of ``benchmarks/sage_bench.py`` helpers (the benchmark itself needs CUDA and sageattention)."""

import pytest
import torch

from diffusers_omni.attention.plan import AttentionPlan
from diffusers_omni.installer import plan_attention
from diffusers_omni.attention.platform import Platform
from diffusers_omni.attention.selector import BackendNotSupportedError


@pytest.fixture(scope="module")
def bench():
    from benchmarks import sage_bench

    return sage_bench


def test_predicted_padding_error_vanishes_at_block_multiples(bench):
    g = torch.Generator().manual_seed(0)
    for kv_len, expected in ((64, 0.0), (128, 0.0), (77, 0.283)):
        q, k, v = (torch.randn(1, n, 2, 64, generator=g) for n in (256, kv_len, kv_len))
        assert bench.predicted_padding_error(q, k, v) == pytest.approx(expected, abs=0.02)


def test_head_dim_64_pipelines_take_sage_on_a_simulated_hopper(bench):
    """The rebuilt tiny transformers have head_dim 64 (FLUX RoPE axes summing to it), are in eval mode, and pass
    the sageattention 1.0.6 head_dim rule that refused the unmodified tiny pipelines on the H200."""
    hopper = Platform(*bench.SIMULATED_PLATFORM)
    pipelines = bench.tiny_head_dim_64_pipelines()
    assert sum(pipelines["FLUX.1 (tiny, head_dim 64)"][0].transformer.config.axes_dims_rope) == 64
    with bench._counting_sage_kernel({}, fake=True):
        for pipe, _call in pipelines.values():
            transformer = pipe.transformer.to(torch.bfloat16)
            assert transformer.config.attention_head_dim == 64 and not transformer.training
            _, plan = plan_attention(transformer, AttentionPlan.build("SAGE_ATTN", hopper))
            assert {r.backend for _, resolutions in plan for r in resolutions.values()} == {"SAGE_ATTN"}
        from diffusers_omni.testing import tiny_wan_components

        with pytest.raises(BackendNotSupportedError, match=r"head_dim is 12; sageattention 1.0.6 requires"):
            wan = tiny_wan_components(0)["transformer"].to(torch.bfloat16)
            plan_attention(wan, AttentionPlan.build("SAGE_ATTN", hopper))


def test_counting_kernel_restores_the_kernel_boundary(bench):
    from diffusers_omni.attention.backends import base
    from diffusers_omni.attention.backends.sage import backend as sage

    saved = sage._import_sageattention, sage.installed_version, base.package_importable
    with bench._counting_sage_kernel({}, fake=True):
        assert base.package_importable("sageattention")
    assert (sage._import_sageattention, sage.installed_version, base.package_importable) == saved


def test_markdown_keeps_multiline_errors_on_one_table_row(bench):
    results = {
        "device": "X",
        "sageattention": "1.0.6",
        "torch": "2",
        "kernels": [],
        "kv_sweep": [],
        "pipelines": [{"pipeline": "p", "config": "c", "error": "E: line one\n  - line two"}],
    }
    table = bench.to_markdown(results).split("| Pipeline |")[1]
    assert "| p | c |  | E: line one   - line two |" in table
