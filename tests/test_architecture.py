"""kvtool's import graph against docs/architecture.md, the one place its layers and line budgets are declared.

The checks are plain functions over a graph ({module: {imported module}}) and line counts, run on kvtool's
own source and, each once, on a small made-up graph that breaks it (so every check can fail).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
MAX_MODULE_LINES = 400
# modules that must not come back: (module, why) -- the engine keeps one decoder and one in-memory form of KV
RETIRED = [("kvtool.engine.static", "a second decoder with KV rows of its own; every device runs ModelRunner.run"),
           ("kvtool.engine.decode_step", "that decoder's forward; the runner's forward serves every device")]


# ---- the declaration ------------------------------------------------------------------------------------


def _table(text: str, heading: str) -> list[list[str]]:
    """The rows of the first markdown table under `## heading`, cells stripped, header and rule dropped."""
    section = re.split(r"^## ", text, flags=re.M)
    body = next((s for s in section if s.splitlines()[0].strip() == heading), None)
    if body is None:
        raise ValueError(f"{DOC.name} has no section '## {heading}'")
    rows = [line.strip().strip("|").split("|") for line in body.splitlines() if line.strip().startswith("|")]
    return [[c.strip() for c in row] for row in rows[2:]]


def parse_layers(text: str) -> list[tuple[str, list[str], set[str]]]:
    """[(layer, packages, layers it may import)], lowest first. 'all below' names every lower layer."""
    layers = []
    for name, packages, may in _table(text, "Layers"):
        below = [n for n, _, _ in layers]
        if may == "all below":
            allowed = set(below)
        elif may.startswith("("):
            allowed = set()
        else:
            allowed = {m.strip() for m in may.split(",")}
            unknown = allowed - set(below)
            if unknown:
                raise ValueError(f"layer {name} may import {sorted(unknown)}, which are not layers below it")
        layers.append((name, [p.strip() for p in packages.split(",")], allowed))
    return layers


def parse_diagram(text: str) -> tuple[set[str], list[tuple[str, str]]]:
    """The nodes and arrows (from, to) of the page's mermaid diagram."""
    match = re.search(r"^```mermaid\n(.*?)^```", text, flags=re.M | re.S)
    if match is None:
        raise ValueError(f"{DOC.name} has no mermaid diagram")
    nodes, arrows = set(), []
    for line in match.group(1).splitlines()[1:]:
        names = [re.sub(r"\[.*?\]", "", side).strip() for side in re.split(r"-->", line)]
        sides = [[n.strip() for n in side.split("&")] for side in names]
        for side in sides:
            nodes.update(n for n in side if n)
        for src, dst in zip(sides, sides[1:]):
            arrows += [(a, b) for a in src for b in dst]
    return nodes, arrows


def diagram_problems(layers, nodes: set[str], arrows: list[tuple[str, str]]) -> list[str]:
    """The diagram draws every layer and only layers, and each arrow points at a layer below its source."""
    order = [name for name, _, _ in layers]
    problems = [f"layer {n} is not in the diagram" for n in order if n not in nodes]
    problems += [f"the diagram draws {n}, which is not a layer" for n in sorted(nodes - set(order))]
    problems += [f"arrow {a} --> {b} does not point down" for a, b in arrows
                 if a in order and b in order and order.index(b) >= order.index(a)]
    return problems


def parse_budgets(text: str) -> dict[str, int]:
    return {package: int(budget.replace(",", "")) for package, budget in _table(text, "Line budgets")}


# ---- the code -------------------------------------------------------------------------------------------


def module_files(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for path in sorted((root / "kvtool").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """{module: kvtool modules it imports}, from every import statement (inside functions too). `from a import b`
    counts a.b when that is a module, else a; a relative import is resolved against the importing package."""
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                for alias in node.names:
                    targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base)
        found = set()
        for target in targets:
            while target and target not in files:  # `import kvtool.a.b.c`: the deepest module that exists
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
        graph[name] = found
    return graph


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


# ---- the checks -----------------------------------------------------------------------------------------


def layer_violations(graph: dict[str, set[str]], layers) -> list[str]:
    """Every import from a package into a layer above its own or one its row does not list; an undeclared
    package is a violation too."""
    layer_of = {p: (i, name, allowed) for i, (name, packages, allowed) in enumerate(layers) for p in packages}
    out = []
    for module in sorted(graph):
        if package_of(module) not in layer_of:
            out.append(f"{module}: package {package_of(module)!r} is in no layer of {DOC.name}")
            continue
        rank, name, allowed = layer_of[package_of(module)]
        for target in sorted(graph[module]):
            t_rank, t_name, _ = layer_of.get(package_of(target), (None, None, None))
            if t_rank is None or t_name == name:
                continue  # an undeclared target is reported as a module of its own
            if t_rank > rank:
                out.append(f"{module} -> {target}: up from layer {name} to layer {t_name}")
            elif t_name not in allowed:
                out.append(f"{module} -> {target}: layer {name} may not import layer {t_name}")
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def long_modules(lines: dict[str, int], limit: int = MAX_MODULE_LINES) -> list[str]:
    return [f"{m}: {n} lines, over {limit}" for m, n in sorted(lines.items()) if n > limit]


def over_budget(lines: dict[str, int], budgets: dict[str, int]) -> list[str]:
    totals: dict[str, int] = {}
    for module, n in lines.items():
        totals[package_of(module)] = totals.get(package_of(module), 0) + n
    out = [f"package {p}: {n} lines, over its budget {budgets[p]}" for p, n in sorted(totals.items())
           if p in budgets and n > budgets[p]]
    return out + [f"package {p} has no line budget in {DOC.name}" for p in sorted(totals) if p not in budgets]


def retired_modules(modules) -> list[str]:
    return [f"{module} is back: {why}" for module, why in RETIRED if module in modules]


# ---- kvtool itself --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def declared():
    text = DOC.read_text(encoding="utf-8")
    return parse_layers(text), parse_budgets(text)


@pytest.fixture(scope="module")
def code():
    files = module_files()
    lines = {m: len(p.read_text(encoding="utf-8").splitlines()) for m, p in files.items()}
    return import_graph(files), lines


def test_the_declaration_names_every_package_once(declared, code):
    layers, budgets = declared
    packages = [p for _, ps, _ in layers for p in ps]
    assert len(packages) == len(set(packages)), "a package is in two layers"
    assert {package_of(m) for m in code[0]} <= set(packages)
    assert set(budgets) == set(packages)


def test_imports_point_down(declared, code):
    assert layer_violations(code[0], declared[0]) == []


def test_no_circles(code):
    assert circles(code[0]) == []


def test_modules_are_small(code):
    assert long_modules(code[1]) == []


def test_packages_keep_their_budgets(declared, code):
    assert over_budget(code[1], declared[1]) == []


def test_retired_modules_stay_gone(code):
    assert retired_modules(code[0]) == []


def test_the_graph_sees_imports_inside_functions(code):
    graph = code[0]
    assert "kvtool.skills.selective" in graph["kvtool.skills.repair"]  # inside RecomputeFirstK.place


# ---- each check fails when it should ----------------------------------------------------------------------

DOC_SAMPLE = """# x

## Layers

| layer | packages | may import |
|---|---|---|
| base | errors, config | (its own layer only) |
| cache | cache | base |
| engine | engine | all below |
| server | serving | engine |

## Line budgets

| package | budget |
|---|---|
| cache | 10 |
| engine | 1,000 |
"""


def test_parse_reads_layers_and_budgets():
    layers = parse_layers(DOC_SAMPLE)
    assert [(n, ps) for n, ps, _ in layers] == [("base", ["errors", "config"]), ("cache", ["cache"]),
                                                ("engine", ["engine"]), ("server", ["serving"])]
    assert [a for _, _, a in layers] == [set(), {"base"}, {"base", "cache"}, {"engine"}]
    assert parse_budgets(DOC_SAMPLE) == {"cache": 10, "engine": 1000}
    with pytest.raises(ValueError, match="not layers below it"):
        parse_layers(DOC_SAMPLE.replace("| cache | cache | base |", "| cache | cache | engine |"))


def test_layer_check_catches_an_upward_and_an_unlisted_import():
    layers = parse_layers(DOC_SAMPLE)
    graph = {"kvtool.cache.kv": {"kvtool.engine.scheduler", "kvtool.errors"}, "kvtool.engine.scheduler": {"kvtool.cache.kv"},
             "kvtool.serving.app": {"kvtool.cache.kv", "kvtool.engine.scheduler"}, "kvtool.errors": set(),
             "kvtool.viz.plots": set()}
    assert layer_violations(graph, layers) == [
        "kvtool.cache.kv -> kvtool.engine.scheduler: up from layer cache to layer engine",
        "kvtool.serving.app -> kvtool.cache.kv: layer server may not import layer cache",
        f"kvtool.viz.plots: package 'viz' is in no layer of {DOC.name}"]


def test_circle_check_finds_a_loop_through_three_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_size_checks_catch_a_long_module_and_a_package_over_budget():
    lines = {"kvtool.cache.kv": 401, "kvtool.cache.index": 5, "kvtool.engine.scheduler": 400, "kvtool.viz.plots": 3}
    assert long_modules(lines) == ["kvtool.cache.kv: 401 lines, over 400"]
    assert over_budget(lines, {"cache": 406, "engine": 400, "viz": 3}) == []
    assert over_budget(lines, {"cache": 405, "engine": 400}) == [
        "package cache: 406 lines, over its budget 405", f"package viz has no line budget in {DOC.name}"]


def test_retired_check_names_a_module_that_came_back(tmp_path):
    (tmp_path / "kvtool" / "engine").mkdir(parents=True)
    (tmp_path / "kvtool" / "engine" / "static.py").write_text("")
    assert retired_modules(module_files(tmp_path)) == [f"kvtool.engine.static is back: {RETIRED[0][1]}"]


def test_import_graph_resolves_relative_and_function_level_imports(tmp_path):
    pkg = tmp_path / "kvtool"
    (pkg / "cache").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "cache" / "__init__.py").write_text("from . import kv\n")
    (pkg / "cache" / "kv.py").write_text("def f():\n    from kvtool.errors import X\n    import kvtool.cache.store.y\n")
    (pkg / "cache" / "store.py").write_text("from .kv import f\nfrom ..errors import E\n")
    graph = import_graph(module_files(tmp_path))
    assert graph == {"kvtool": set(), "kvtool.errors": set(), "kvtool.cache": {"kvtool.cache.kv"},
                     "kvtool.cache.kv": {"kvtool.errors", "kvtool.cache.store"},
                     "kvtool.cache.store": {"kvtool.cache.kv", "kvtool.errors"}}
    assert circles(graph) == [["kvtool.cache.kv", "kvtool.cache.store"]]


def test_the_mermaid_diagram_draws_the_layers_pointing_down(declared):
    nodes, arrows = parse_diagram(DOC.read_text())
    layers, _ = declared
    assert arrows and diagram_problems(layers, nodes, arrows) == []


def test_a_diagram_with_an_upward_arrow_or_a_missing_layer_fails():
    layers = [("base", [], set()), ("cache", [], {"base"}), ("engine", [], {"base", "cache"})]
    assert diagram_problems(layers, {"base", "cache", "engine"}, [("engine", "cache"), ("cache", "base")]) == []
    assert diagram_problems(layers, {"base", "cache", "engine"}, [("cache", "engine")]) == [
        "arrow cache --> engine does not point down"]
    assert diagram_problems(layers, {"base", "engine", "gpu"}, []) == [
        "layer cache is not in the diagram", "the diagram draws gpu, which is not a layer"]
