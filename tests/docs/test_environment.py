"""docs/environment.md lists every environment variable the package reads.

The package's source is scanned for reads (``os.environ.get(X)``, ``os.environ[X]``, ``os.getenv(X)``,
``X in os.environ``) and module constants named ``ENV_*``. ``X`` is resolved through string literals, module
constants (``ENV_BACKEND = "DIFFUSION_ATTENTION_BACKEND"``) and one level of helper functions whose parameter is the
name read (``_env(f"DIFFUSERS_OMNI_{self.name}_REVISION", ENV_REVISION)``); the ``{...}`` of an f-string is written
``<NAME>``, as the page writes it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "environment.md"


def _is_os_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name) \
        and node.value.id == "os"


def _read_argument(node: ast.AST) -> ast.AST | None:
    """The expression naming the variable, when ``node`` reads the environment."""
    if isinstance(node, ast.Call) and node.args:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in ("get", "pop", "setdefault") and _is_os_environ(func.value):
            return node.args[0]
        if isinstance(func, ast.Attribute) and func.attr == "getenv" and isinstance(func.value, ast.Name) \
                and func.value.id == "os":
            return node.args[0]
    if isinstance(node, ast.Subscript) and _is_os_environ(node.value):
        return node.slice
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn)) \
            and _is_os_environ(node.comparators[0]):
        return node.left
    return None


def _string(node: ast.AST, constants: dict[str, str]) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name) and node.id in constants:
        return constants[node.id]
    if isinstance(node, ast.JoinedStr):
        return "".join(part.value if isinstance(part, ast.Constant) else "<NAME>" for part in node.values)
    return None


def environment_variables(source: str) -> set[str]:
    """Names of the environment variables one module reads (see the module docstring)."""
    tree = ast.parse(source)
    constants = {
        target.id: node.value.value
        for node in tree.body if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        for target in node.targets if isinstance(target, ast.Name)
    }
    found = {value for name, value in constants.items() if name.startswith("ENV_")}
    # Functions reading a parameter: name → positional indexes of the parameters it reads.
    readers: dict[str, set[int]] = {}
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        params = [a.arg for a in function.args.posonlyargs + function.args.args]
        for node in ast.walk(function):
            argument = _read_argument(node)
            if isinstance(argument, ast.Name) and argument.id in params and argument.id not in constants:
                readers.setdefault(function.name, set()).add(params.index(argument.id))
    for node in ast.walk(tree):
        argument = _read_argument(node)
        if argument is not None:
            name = _string(argument, constants)
            if name is not None:
                found.add(name)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in readers:
            for index in readers[node.func.id]:
                if index < len(node.args) and (name := _string(node.args[index], constants)) is not None:
                    found.add(name)
    return found


def package_environment_variables() -> dict[str, list[str]]:
    """Variable → the package files that read it."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "diffusers_omni").rglob("*.py")):
        for name in environment_variables(path.read_text()):
            found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def test_every_variable_the_package_reads_is_on_the_page():
    page = PAGE.read_text()
    found = package_environment_variables()
    missing = {name: files for name, files in found.items() if f"`{name}`" not in page}
    assert not missing, f"document these in {PAGE.relative_to(ROOT)}: {missing}"


def test_the_scan_finds_the_known_variables():
    found = package_environment_variables()
    assert {"DIFFUSION_ATTENTION_BACKEND", "DIFFUSERS_ATTN_BACKEND", "DIFFUSERS_OMNI_DETERMINISTIC",
            "DIFFUSERS_OMNI_HUB_KERNEL_REVISION", "DIFFUSERS_OMNI_<NAME>_LOCAL_PATH", "TRITON_INTERPRET",
            "LOCAL_RANK", "RANK"} <= set(found)


def test_the_scan_resolves_literals_constants_fstrings_and_helpers():
    source = '''
import os
ENV_A = "PKG_A"
ENV_UNUSED = "PKG_DECLARED"
def _env(name, fallback):
    return os.environ.get(name) or os.getenv(fallback)
def f(kind):
    os.environ.get(ENV_A)
    os.environ["PKG_B"]
    "PKG_C" in os.environ
    _env(f"PKG_{kind}_PATH", "PKG_D")
'''
    assert environment_variables(source) == {"PKG_A", "PKG_DECLARED", "PKG_B", "PKG_C", "PKG_<NAME>_PATH", "PKG_D"}

