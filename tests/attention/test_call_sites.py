"""Routed processors send each attention call to the role declared for its call site (named by the variable
Diffusers assigns its result to), whatever order the calls come in and whichever are skipped."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.attention_dispatch import dispatch_attention_fn

from diffusers_omni.attention import callsites
from diffusers_omni.attention.processors import RoleAttention, bind_routed
from diffusers_omni.attention.registry import get_backend_class


class TwoCallProcessor:
    """Text cross-attention and image cross-attention, as Wan 2.1 I2V's ``attn2`` makes them, except that the order
    of the two calls and whether each runs is up to the caller. ``dispatch_attention_fn`` takes ``[B, S, H, D]``."""

    def __call__(self, attn, query, text, image=None, image_first=False, skip_text=False):
        out = torch.zeros_like(query)
        if image is not None and image_first:
            hidden_states_img = dispatch_attention_fn(query, image, image)
            out = out + hidden_states_img
        if not skip_text:
            hidden_states = dispatch_attention_fn(query, text, text)
            out = out + hidden_states
        if image is not None and not image_first:
            hidden_states_img = dispatch_attention_fn(query, image, image)
            out = out + hidden_states_img
        return out


class ClassicProcessor:
    """The same two calls through ``F.scaled_dot_product_attention`` on ``[B, H, S, D]`` tensors, as Diffusers'
    classic IP-Adapter processors make them."""

    def __call__(self, attn, query, text, image=None, image_first=False):
        out = torch.zeros_like(query)
        if image is not None and image_first:
            ip_hidden_states = F.scaled_dot_product_attention(query, image, image)
            out = out + ip_hidden_states
        hidden_states = F.scaled_dot_product_attention(query, text, text)
        out = out + hidden_states
        if image is not None and not image_first:
            ip_hidden_states = F.scaled_dot_product_attention(query, image, image)
            out = out + ip_hidden_states
        return out


def _recording_roles(*roles: str) -> tuple[dict[str, RoleAttention], list[tuple[str, int]]]:
    """A ``RoleAttention`` per role on the real TORCH_SDPA backend, each call recorded as ``(role, key length)``."""
    seen: list[tuple[str, int]] = []
    attend = {}
    for role in roles:
        backend = get_backend_class("TORCH_SDPA")()
        resolution = types.SimpleNamespace(role=role, backend="TORCH_SDPA")
        attention = RoleAttention(resolution, backend)

        def record(query, key, value, *rest, _backend=backend, _role=role):
            seen.append((_role, key.shape[1]))  # [B, S, H, D]
            return _backend(query, key, value, *rest)

        attention.backend = record
        attend[role] = attention
    return attend, seen


TEXT, IMAGE = 7, 3  # key lengths: which call a record came from


def _tensors(layout_bhsd: bool):
    torch.manual_seed(0)
    shape = lambda s: (1, 2, s, 8) if layout_bhsd else (1, s, 2, 8)  # noqa: E731
    return torch.randn(shape(5)), torch.randn(shape(TEXT)), torch.randn(shape(IMAGE))


@pytest.mark.parametrize("image_first", [False, True])
@pytest.mark.parametrize("skip_text", [False, True])
def test_dispatch_calls_go_to_their_declared_role_in_any_order(image_first, skip_text):
    # The module lists its roles text first; by call order (the old rule) an image call made first would have gone
    # to the text role, and with the text call skipped the image call would have been "call 0" as well.
    attend, seen = _recording_roles("toy.text", "toy.image")
    routed = bind_routed(TwoCallProcessor(), attend, calls={"hidden_states_img": "toy.image"})
    query, text, image = _tensors(layout_bhsd=False)
    out = routed(None, query, text, image, image_first=image_first, skip_text=skip_text)
    expected_calls = [("toy.image", IMAGE)] if skip_text else (
        [("toy.image", IMAGE), ("toy.text", TEXT)] if image_first else [("toy.text", TEXT), ("toy.image", IMAGE)]
    )
    assert seen == expected_calls
    stock = TwoCallProcessor()(None, query, text, image, image_first=image_first, skip_text=skip_text)
    assert torch.equal(out, stock)


@pytest.mark.parametrize("image_first", [False, True])
def test_sdpa_calls_go_to_their_declared_role_in_any_order_with_the_same_output(image_first):
    attend, seen = _recording_roles("toy.text", "toy.image")
    routed = bind_routed(ClassicProcessor(), attend, calls={"ip_hidden_states": "toy.image"})
    query, text, image = _tensors(layout_bhsd=True)
    out = routed(None, query, text, image, image_first=image_first)
    assert sorted(seen) == [("toy.image", IMAGE), ("toy.text", TEXT)]
    assert seen[0][0] == ("toy.image" if image_first else "toy.text")
    # TORCH_SDPA gets the [B, S, H, D] views of the tensors SDPA would get: bitwise the stock result.
    assert torch.equal(out, ClassicProcessor()(None, query, text, image, image_first=image_first))


def test_call_sites_are_named_by_their_result():
    sites = callsites.patched(TwoCallProcessor.__call__).sites
    assert [(site.result, site.kind) for site in sites] == [
        ("hidden_states_img", callsites.DISPATCH), ("hidden_states", callsites.DISPATCH),
        ("hidden_states_img", callsites.DISPATCH),
    ]
    assert {site.kind for site in callsites.patched(ClassicProcessor.__call__).sites} == {callsites.SDPA}


def test_a_call_whose_role_the_module_lacks_raises_naming_call_and_role():
    attend, _ = _recording_roles("toy.text")
    routed = bind_routed(TwoCallProcessor(), attend, calls={"hidden_states_img": "toy.image"}, where="module 'x'")
    query, text, image = _tensors(layout_bhsd=False)
    routed(None, query, text)  # the text call alone: its role is the module's one unnamed role
    with pytest.raises(RuntimeError, match=r"module 'x'.*'hidden_states_img'.*'toy.image'"):
        routed(None, query, text, image)


def test_calls_with_no_declared_role_raise_when_the_module_has_several():
    attend, _ = _recording_roles("toy.text", "toy.image")
    routed = bind_routed(TwoCallProcessor(), attend)  # no ``calls``: which role is which is not declared
    query, text, _ = _tensors(layout_bhsd=False)
    with pytest.raises(RuntimeError, match=r"'hidden_states'.*no declared role"):
        routed(None, query, text)
