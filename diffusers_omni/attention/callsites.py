"""The attention calls written in a Diffusers function, each given a global name of its own.

Diffusers' processors attend in one of two ways: ``dispatch_attention_fn(query, key, value, ...)`` on
``[B, S, H, D]`` tensors (the DiT families), or ``F.scaled_dot_product_attention(query, key, value, ...)`` on
``[B, H, S, D]`` tensors (the classic ``attention_processor`` family: SDXL's UNet, SD3, PAG, IP-Adapters). Either
way the function reads a module global at the call: ``dispatch_attention_fn``, or ``F``.

``patched(function)`` finds every such call in the function's source, names it by what Diffusers assigns its
result to (``hidden_states``, ``current_ip_hidden_states``, ``hidden_states_ptb``; ``return`` for a call that is
returned) and returns the function's code with each call reading a global of its own instead (``CallSite.name``).
A processor re-created over a namespace that binds those globals (``processors._Route``) sends every call to the
role its site was declared for: which call is which is read from the code, never from the order the calls come in.
"""

from __future__ import annotations

import ast
import dis
import inspect
import itertools
import sys
import types
from dataclasses import dataclass

import torch

# The name Diffusers' model modules call their attention through (diffusers.models.attention_dispatch).
DISPATCH_NAME = "dispatch_attention_fn"
SDPA_NAME = "scaled_dot_product_attention"

DISPATCH = "dispatch"  # dispatch_attention_fn: [B, S, H, D]
SDPA = "sdpa"  # F.scaled_dot_product_attention: [B, H, S, D]

_POSITIONS = sys.version_info >= (3, 11)


@dataclass(frozen=True)
class CallSite:
    """One attention call written in a function.

    Attributes:
        result: what Diffusers names the call's result (``hidden_states_img``); ``return`` for ``return f(...)``,
            ``expression`` for a call in any other expression.
        kind: ``DISPATCH`` or ``SDPA``.
        function: the qualified name of the function it is written in.
        line: its line in that function's file.
        name: the global the patched code reads at this call.
    """

    result: str
    kind: str
    function: str
    line: int
    name: str


@dataclass(frozen=True)
class Patched:
    code: types.CodeType
    sites: tuple[CallSite, ...]


_COUNTER = itertools.count()
_PATCHED: dict[types.CodeType, Patched] = {}


def _aliases(namespace: dict) -> set[str]:
    """The globals naming ``torch.nn.functional`` (``F`` in Diffusers)."""
    return {name for name, value in namespace.items() if value is torch.nn.functional}


def _candidate(code: types.CodeType, aliases: set[str]) -> bool:
    """Whether ``code`` (or code nested in it) may hold an attention call (a cheap test before reading sources)."""
    stack = [code]
    while stack:
        code = stack.pop()
        names = set(code.co_names)
        if DISPATCH_NAME in names or (SDPA_NAME in names and names & aliases):
            return True
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return False


def _key(line: int | None, column: int | None) -> tuple:
    return (line, column) if _POSITIONS else (line,)


def _source_sites(function: types.FunctionType, aliases: set[str]) -> dict[tuple, tuple[str, str]]:
    """``{position of the global read at the call: (kind, result name)}`` for every attention call in the source."""
    lines, first = inspect.getsourcelines(function)
    source = "".join(lines)
    if lines[0][:1].isspace():  # a method: parse it as the body of a block, columns unchanged
        tree, offset = ast.parse("if 1:\n" + source), first - 2
    else:
        tree, offset = ast.parse(source), first - 1
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id == DISPATCH_NAME:
            target, kind = func, DISPATCH
        elif (isinstance(func, ast.Attribute) and func.attr == SDPA_NAME and isinstance(func.value, ast.Name)
              and func.value.id in aliases):
            target, kind = func.value, SDPA
        else:
            continue
        parent = parents.get(node)
        if isinstance(parent, ast.Assign) and len(parent.targets) == 1 and isinstance(parent.targets[0], ast.Name):
            result = parent.targets[0].id
        elif isinstance(parent, ast.AnnAssign) and isinstance(parent.target, ast.Name):
            result = parent.target.id
        elif isinstance(parent, ast.Return):
            result = "return"
        else:
            result = "expression"
        found[_key(target.lineno + offset, target.col_offset)] = (kind, result)
    return found


def _patch(code: types.CodeType, found: dict, qualname: str, sites: list[CallSite]) -> types.CodeType:
    consts = tuple(_patch(c, found, qualname, sites) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    names = list(code.co_names)
    raw = bytearray(code.co_code)
    instructions = list(dis.get_instructions(code))
    line = None
    for index, ins in enumerate(instructions):
        if not _POSITIONS and ins.starts_line is not None:
            line = ins.starts_line
        if ins.opname != "LOAD_GLOBAL":
            continue
        position = _key(ins.positions.lineno, ins.positions.col_offset) if _POSITIONS else _key(line, None)
        kind_result = found.get(position)
        following = instructions[index + 1] if index + 1 < len(instructions) else None
        is_site = ins.argval == DISPATCH_NAME or (
            following is not None and following.opname in ("LOAD_ATTR", "LOAD_METHOD") and following.argval == SDPA_NAME
        )
        if kind_result is None:
            if is_site:
                raise TypeError(f"{qualname}: an attention call at line {position[0]} was not found in its source")
            continue
        kind, result = kind_result
        name = f"__omni_attention_call_{next(_COUNTER)}"
        sites.append(CallSite(result, kind, qualname, position[0], name))
        arg = (len(names) << 1 | (ins.arg & 1)) if _POSITIONS else len(names)
        names.append(name)
        if ins.arg > 255 or arg > 255:
            raise TypeError(f"{qualname}: too many global names to route its attention call at line {position[0]}")
        raw[ins.offset + 1] = arg
    return code.replace(co_code=bytes(raw), co_names=tuple(names), co_consts=consts)


def patched(function: types.FunctionType) -> Patched:
    """``function``'s code with each attention call reading a global of its own, and the calls (cached)."""
    code = function.__code__
    cached = _PATCHED.get(code)
    if cached is None:
        aliases = _aliases(function.__globals__)
        if not _candidate(code, aliases):
            cached = Patched(code, ())
        else:
            sites: list[CallSite] = []
            new = _patch(code, _source_sites(function, aliases), function.__qualname__, sites)
            cached = Patched(new, tuple(sites))
        _PATCHED[code] = cached
    return cached


def has_calls(function: types.FunctionType) -> bool:
    """Whether ``function`` holds an attention call of either kind (source read only when its code may)."""
    return _candidate(function.__code__, _aliases(function.__globals__)) and bool(patched(function).sites)
