"""The package's layers (README, "Architecture"): a call goes down them once, and no module of
gradops/ imports one that imports it back, directly or around a circle of any length.

nn/ asks ops/ for a call's plan and launches it; nothing in ops/, reference/ or kernels/ imports
nn/. gradops.distributed builds on nn/: where nn meets a DTensor it hands the call to what
distributed registered with it when imported (``nn._custom_ops.DTENSOR_HANDLERS``), and never
imports distributed. Likewise ``nn._triton_ops`` is given the norm ops' parts by ``nn._norms``.

The graph: a node per module (a package is its ``__init__``), an edge per import statement
anywhere in the module, at module level or inside a function or class: a lazy import ties its
module to the one it imports as much as a module-level one does (it runs whenever the function
does). Names resolve as Python resolves them:

- ``import a.b`` is module ``a.b``; ``from a.b import c`` is module ``a.b.c`` where that is a
  module (``from . import x`` names module x), else module ``a.b`` (a name it defines);
  relative imports count from the importing module's package (a package's ``__init__`` is
  in the package itself);
- the parent packages Python runs before a module (``gradops``, ``gradops.nn`` before
  ``gradops.nn.functional``) are no edges: a module that imports ``gradops.errors`` uses
  errors, not what ``gradops/__init__`` re-exports, and Python runs a parent package's
  ``__init__`` to its end before any submodule it does not import itself, so this order never
  hands a module a half-run one. An explicit import of a package (``import gradops`` or
  ``from gradops import floyd_attention`` in a module) is an edge to its ``__init__``: the
  module uses what the package exports;
- imports by computed name (``importlib.import_module``: ``_backend``'s choice of backend
  module, the bench CLI's family) are not seen.

Every strongly connected component of two or more modules is a circle, named with one of its
cycles; there is none."""
import ast
import functools
import json
import pathlib
import subprocess
import sys
from typing import Dict, Iterable, List, Set

import gradops

PACKAGE = pathlib.Path(gradops.__file__).parent

def _module_name(path: pathlib.Path) -> str:
    parts = ("gradops",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def resolved_imports(module: str, is_package: bool, source: str, modules: Iterable[str]) -> Dict[str, int]:
    """The modules of ``modules`` that ``source`` (module ``module``'s text) imports anywhere in
    it, resolved as the module docstring says, each with the line of its first import."""
    modules = set(modules)
    package = module if is_package else module.rpartition(".")[0]
    found: Dict[str, int] = {}

    def add(name: str, line: int):
        if name in modules and name != module:
            found.setdefault(name, line)

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            name = node.module if not node.level else ".".join(p for p in (base, node.module) if p)
            for alias in node.names:
                add(f"{name}.{alias.name}" if f"{name}.{alias.name}" in modules else name, node.lineno)
    return dict(sorted(found.items(), key=lambda item: item[1]))


@functools.lru_cache(maxsize=None)
def imports_of(module: str) -> Dict[str, int]:
    path = MODULES[module]
    return resolved_imports(module, path.name == "__init__.py", path.read_text(), MODULES)


def strongly_connected(graph: Dict[str, Iterable[str]]) -> List[List[str]]:
    """The strongly connected components of ``graph`` with two or more nodes, each sorted
    (Tarjan's algorithm)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    components = []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components)


def a_cycle(graph: Dict[str, Dict[str, int]], component: List[str]) -> str:
    """One cycle through the component's first module, with the line of each import."""
    start, members = component[0], set(component)
    came_from = {start: None}
    frontier = [start]
    while frontier:  # breadth first: the shortest way back to start
        following = []
        for node in frontier:
            for nxt in sorted(graph[node]):
                if nxt == start:
                    path = [node]
                    while came_from[path[-1]] is not None:
                        path.append(came_from[path[-1]])
                    path = path[::-1] + [start]
                    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(path, path[1:])) + f" -> {start}"
                if nxt in members and nxt not in came_from:
                    came_from[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {component}")


def test_no_module_imports_one_that_imports_it_back():
    graph = {module: imports_of(module) for module in MODULES}
    circles = strongly_connected(graph)
    assert not circles, "import circles:\n" + "\n".join(f"{', '.join(c)}: {a_cycle(graph, c)}" for c in circles)


def test_the_scan_resolves_imports_as_python_does():
    modules = {"gradops", "gradops.errors", "gradops.nn", "gradops.nn._floyd", "gradops.nn._custom_ops",
               "gradops.nn.functional", "gradops.ops", "gradops.ops._checks", "gradops.bench",
               "gradops.bench.harness"}
    source = ("from ..errors import AclnnError\n"          # 1: a module, through the parent packages
              "from . import _floyd\n"                      # 2: `from . import x` names module x
              "from ._custom_ops import fresh\n"            # 3: a name of a module: that module
              "import torch\n"                              # 4: not gradops
              "def f():\n"
              "    import gradops\n"                        # 6: inside a function, the package itself
              "    from ..ops import _checks\n"             # 7
              "    from gradops.nn import functional\n"     # 8
              "    import gradops.bench.harness\n")         # 9: the module, not its packages
    assert resolved_imports("gradops.nn.pivotal", False, source, modules) == {
        "gradops.errors": 1, "gradops.nn._floyd": 2, "gradops.nn._custom_ops": 3, "gradops": 6,
        "gradops.ops._checks": 7, "gradops.nn.functional": 8, "gradops.bench.harness": 9}
    # in a package's __init__, `.` is the package itself; a name it exports is an edge to it
    init = "from .functional import floyd_attention\nfrom .. import errors\nfrom gradops import nn\n"
    assert resolved_imports("gradops.nn", True, init, modules) == {"gradops.nn.functional": 1, "gradops.errors": 2}
    assert resolved_imports("gradops.bench.harness", False, "from gradops import floyd_attention\n",
                            modules) == {"gradops": 1}


def test_the_search_finds_every_circle_and_names_one_cycle():
    graph = {"a": {"b": 1}, "b": {"c": 2, "d": 3}, "c": {"a": 4}, "d": {"e": 5}, "e": {"d": 6}, "f": {"a": 7}}
    assert strongly_connected(graph) == [["a", "b", "c"], ["d", "e"]]
    assert a_cycle(graph, ["a", "b", "c"]) == "a (line 1) -> b (line 2) -> c (line 4) -> a"


def test_the_lower_layers_never_import_nn():
    for layer in ("ops", "reference", "kernels"):
        for module in sorted(m for m in MODULES if m.startswith(f"gradops.{layer}")):
            up = sorted(name for name in imports_of(module) if name.startswith("gradops.nn"))
            assert not up, f"{module} imports {up}"


def test_nn_never_imports_distributed():
    for module in sorted(m for m in MODULES if m.startswith("gradops.nn")):
        up = sorted(name for name in imports_of(module) if name.startswith("gradops.distributed"))
        assert not up, f"{module} imports {up}"


def test_importing_gradops_hands_nn_its_dtensor_calls_without_importing_dtensor():
    # a DTensor can reach nn only once torch.distributed.tensor is imported, and then gradops is too
    code = ("import json, sys, torch; dtensor = 'torch.distributed.tensor'; before = dtensor in sys.modules; "
            "import gradops; from gradops.nn._custom_ops import DTENSOR_HANDLERS; "
            "print(json.dumps([sorted(DTENSOR_HANDLERS), before, dtensor in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=PACKAGE.parent, check=True).stdout
    handlers, before, after = json.loads(out)
    assert handlers == ["pivotal_attention", "rules", "same_mesh"]
    assert after == before, "import gradops imported torch.distributed.tensor"


def test_the_norm_functionals_plan_in_ops_and_launch_in_nn():
    # nn/_norms asks ops.norm_functional for the call's plan; the functional's checks live there
    norms = imports_of("gradops.nn._norms")
    assert "gradops.ops.norm_functional" in norms
    assert "gradops.ops._plans" not in norms and "gradops.ops._shapes" not in norms
