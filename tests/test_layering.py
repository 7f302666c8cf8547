"""The package's layers (README, "Architecture"): a call goes down them once. nn/ asks ops/ for
a call's plan and launches it; nothing in ops/, reference/ or kernels/ imports nn/ (at module
level or inside a function), and the norm kernels' modules import one another without cycles.
(Floyd's floyd_config and floyd_roofline still import each other, the rule inside a function:
not yet untangled.)"""
import ast
import pathlib

import gradops

PACKAGE = pathlib.Path(gradops.__file__).parent


def imports_of(path: pathlib.Path):
    """The gradops modules ``path`` imports anywhere in it, as dotted names."""
    module = "gradops." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
    package = module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("gradops")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            if name.startswith("gradops"):
                found.add(name)
                found |= {f"{name}.{a.name}" for a in node.names}  # `from . import x` names a module
    return found


def test_the_lower_layers_never_import_nn():
    for layer in ("ops", "reference", "kernels"):
        for path in sorted((PACKAGE / layer).glob("*.py")):
            up = sorted(name for name in imports_of(path) if name.startswith("gradops.nn"))
            assert not up, f"{path.relative_to(PACKAGE)} imports {up}"


def test_the_norm_kernel_modules_import_one_another_without_cycles():
    paths = {f"gradops.kernels.{p.stem}": p for p in (PACKAGE / "kernels").glob("*.py")
             if "floyd" not in p.stem and "nsa" not in p.stem}
    graph = {name: {m for m in imports_of(path) if m in paths and m != name} for name, path in paths.items()}
    state = {}

    def visit(name, trail):
        state[name] = "open"
        for dep in sorted(graph[name]):
            assert state.get(dep) != "open", "import cycle: " + " -> ".join(trail + [name, dep])
            if dep not in state:
                visit(dep, trail + [name])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert "gradops.kernels._norm_common" in graph["gradops.kernels.layer_norm"]  # (the scan sees imports)


def test_the_norm_functionals_plan_in_ops_and_launch_in_nn():
    # nn/_norms asks ops.norm_functional for the call's plan; the functional's checks live there
    norms = imports_of(PACKAGE / "nn" / "_norms.py")
    assert "gradops.ops.norm_functional" in norms
    assert "gradops.ops._plans" not in norms and "gradops.ops._shapes" not in norms
