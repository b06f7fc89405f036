"""The package's imports go one direction (docs/design/layers.md).

Every module of ``diffusers_omni`` is read with ``ast``; each import it makes (at module level or inside a function,
but not under ``if TYPE_CHECKING:``) is mapped to a layer and checked against the layers that layer may use. A second
test checks that no two modules import each other, directly or around a circle. ``testing/`` may import only
Diffusers, Transformers, torch and the standard library; ``benchmarks/`` uses public names only and never edits
``sys.path`` (it is a package, run as ``python -m benchmarks.<script>``).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "diffusers_omni"

# Layer of each top-level part of the package, and the layers it may import from (besides itself).
ALLOWED: dict[str, frozenset[str]] = {
    "utils": frozenset(),
    # Model and pipeline classes of systems Diffusers has no class for (NextStep, BAGEL, SoulX-Singer), written in
    # Diffusers' style: plain torch/Diffusers/Transformers code that knows nothing of attention routing or offload.
    "architectures": frozenset({"utils"}),
    "config": frozenset({"utils"}),
    "attention": frozenset({"utils", "config"}),
    "models": frozenset({"utils", "config", "attention", "architectures"}),
    "offload": frozenset({"utils", "config", "models"}),
    "installer": frozenset({"utils", "config", "attention", "models"}),
    "pipelines": frozenset({"utils", "config", "attention", "models", "offload", "installer", "architectures"}),
    "alignment": frozenset({"utils", "config", "attention", "models", "installer"}),
    "cli": frozenset(
        {"utils", "config", "attention", "models", "offload", "installer", "pipelines", "alignment", "testing",
         "architectures"}
    ),
    "root": frozenset({"utils", "config", "attention", "models", "offload", "installer", "pipelines", "alignment",
                       "architectures"}),
    "testing": frozenset({"architectures"}),  # the tiny builders of the systems Diffusers has no class for
}
# Hardware detection imports nothing of the package: routing policy lives in attention/routing.py.
LEAF_MODULES = {"diffusers_omni.attention.platform"}
# testing/quantized.py builds quantized tiny models with the quantization libraries Diffusers integrates (optional
# extras, imported inside its functions).
TESTING_THIRD_PARTY = {"diffusers", "transformers", "tokenizers", "torch", "numpy", "PIL", "gguf", "bitsandbytes",
                       "torchao"}


def _module_name(path: Path, base: Path = ROOT) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("__main__",):
        return "root"
    return parts[1]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, module: str) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, imported names) for every runtime import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target, [alias.name for alias in node.names]))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _package_modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _resolve(target: str, names: list[str], modules: dict[str, Path]) -> list[str]:
    """The package modules an import loads: ``from pkg import submodule`` names the submodule itself."""
    resolved = []
    for name in names:
        if f"{target}.{name}" in modules:
            resolved.append(f"{target}.{name}")
    if target in modules and (not names or len(resolved) < len(names)):
        resolved.append(target)
    return resolved or [target]


def _package_edges() -> list[tuple[str, Path, int, str]]:
    modules = _package_modules()
    edges = []
    for module, path in modules.items():
        for line, target, names in _imports(path, module):
            if target == "diffusers_omni" or target.startswith("diffusers_omni."):
                for imported in _resolve(target, names, modules):
                    edges.append((module, path, line, imported))
    return edges


def layer_violations() -> list[str]:
    problems = []
    for module, path, line, imported in _package_edges():
        layer, target_layer = _layer(module), _layer(imported)
        where = f"{path.relative_to(ROOT)}:{line}: imports {imported}"
        if module in LEAF_MODULES:
            problems.append(f"{where} ({module} imports nothing of the package)")
        elif target_layer != layer and target_layer not in ALLOWED[layer]:
            problems.append(f"{where} ({layer} may import only {', '.join(sorted(ALLOWED[layer])) or 'itself'})")
    return problems


def import_cycles() -> list[str]:
    graph: dict[str, set[str]] = {}
    for module, _, _, imported in _package_edges():
        if imported != module:
            graph.setdefault(module, set()).add(imported)
    cycles, state = [], {}

    def walk(node: str, stack: list[str]) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            # A package's __init__ importing its own submodules is not a circle of imports between modules.
            if node.startswith(nxt + "."):
                continue
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt) :] + [nxt]))
            elif nxt not in state:
                walk(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            walk(node, [])
    return cycles


def test_imports_follow_the_layers():
    problems = layer_violations()
    assert not problems, "imports against the layer rule:\n" + "\n".join(problems)


def test_no_import_cycles():
    cycles = import_cycles()
    assert not cycles, "import circles:\n" + "\n".join(cycles)


def test_testing_imports_only_diffusers_transformers_and_torch():
    problems = []
    for path in sorted((PACKAGE / "testing").rglob("*.py")):
        module = _module_name(path)
        for line, target, _ in _imports(path, module):
            top = target.split(".")[0]
            # The tiny builders of the systems Diffusers has no class for build this package's own classes.
            if target.startswith(("diffusers_omni.testing", "diffusers_omni.architectures")) or top in TESTING_THIRD_PARTY:
                continue
            if top in sys.stdlib_module_names:
                continue
            problems.append(f"{path.relative_to(ROOT)}:{line}: imports {target}")
    assert not problems, "testing/ imports beyond Diffusers/Transformers/torch:\n" + "\n".join(problems)


def private_reach_ins() -> list[str]:
    """Private names (``_x``) taken from another module of the package, by import or as ``module._x``.

    ``testing/`` shares its private builders among its own files, and a private module (``models/_classic.py``)
    serves its package: both stay inside their folder.
    """
    modules = _package_modules()
    problems = []
    for module, path in modules.items():
        if _layer(module) == "testing":
            continue
        bound = set()
        for line, target, names in _imports(path, module):
            if not target.startswith("diffusers_omni"):
                continue
            source_private = target.rpartition(".")[2].startswith("_")
            for name in names:
                if f"{target}.{name}" in modules:
                    bound.add(name)
                elif name.startswith("_") and not name.startswith("__") and not source_private:
                    problems.append(f"{path.relative_to(ROOT)}:{line}: imports private {target}.{name}")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
                if node.attr.startswith("_") and not node.attr.startswith("__"):
                    problems.append(f"{path.relative_to(ROOT)}:{node.lineno}: reaches into {node.value.id}.{node.attr}")
    return problems


def test_no_private_reach_ins():
    problems = private_reach_ins()
    assert not problems, "private names used outside their module:\n" + "\n".join(problems)


def _private_parts(target: str, names: list[str]) -> list[str]:
    parts = target.split(".") + names
    return [p for p in parts if p.startswith("_") and not (p.startswith("__") and p.endswith("__"))]


def test_benchmarks_use_public_names_and_no_path_edits():
    problems = []
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        module = _module_name(path)
        tree = ast.parse(path.read_text(), str(path))
        for line, target, names in _imports(path, module):
            if target.startswith("diffusers_omni") and _private_parts(target, names):
                problems.append(f"{path.relative_to(ROOT)}:{line}: private import {target} {names}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys":
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                problems.append(f"{where}: uses sys.path (run as python -m benchmarks.<script>)")
    assert not problems, "\n".join(problems)


def test_the_layer_walk_sees_imports():
    """The walk is not vacuous: it finds runtime imports, relative ones included, and skips TYPE_CHECKING blocks."""
    edges = _package_edges()
    assert len(edges) > 100
    modules = {(module, imported) for module, _, _, imported in edges}
    assert ("diffusers_omni.attention.selector", "diffusers_omni.attention.registry") in modules
    assert ("diffusers_omni.attention.backends.base", "diffusers_omni.attention.platform") not in modules
