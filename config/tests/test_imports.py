"""No import cycle anywhere in the project, imports inside functions included: a module
that must import another lazily to break a circle is a room in the wrong place."""

from __future__ import annotations

import grimp

PACKAGES = (
    "core",
    "protocol",
    "engine",
    "scorer",
    "accounts",
    "catalog",
    "mahout",
    "hosts",
    "billing",
    "mesh",
    "marketplace",
    "web",
    "config",
    "testkit",
)


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[module] = min(low[module], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == index[module]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == module:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


class ImportCycleTests:
    def test_it_finds_a_cycle_where_there_is_one(self) -> None:
        graph = grimp.ImportGraph()
        for importer, imported in (("a.x", "a.y"), ("a.y", "a.z"), ("a.z", "a.x"), ("a.z", "a.w")):
            graph.add_import(importer=importer, imported=imported)
        assert import_cycles(graph) == [["a.x", "a.y", "a.z"]]

    def test_the_project_has_no_import_cycle(self) -> None:
        graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True)
        assert import_cycles(graph) == []
