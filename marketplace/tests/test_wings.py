"""The marketplace's wings (marketplace/__init__.py) import one another in one direction
only: no two wings import each other, not even through a third. Each subpackage is a wing;
each module of the base (models, services, tasks...) is a room of its own. Imports inside
functions count; the tests and the migrations are no wing."""

from __future__ import annotations

from graphlib import CycleError, TopologicalSorter

import grimp
import pytest

NOT_WINGS = ("tests", "migrations")


def wing(module: str) -> str | None:
    """The wing (or the base's room) `module` belongs to; None for the tests and migrations."""
    parts = module.split(".")
    if len(parts) == 1:
        return None  # the package itself (a docstring)
    return None if parts[1] in NOT_WINGS else f"marketplace.{parts[1]}"


def wing_imports(graph: grimp.ImportGraph) -> dict[str, set[str]]:
    """Each wing and the wings its modules import."""
    imports: dict[str, set[str]] = {}
    for module in graph.modules:
        importer = wing(module)
        if importer is None:
            continue
        imports.setdefault(importer, set())
        for imported in graph.find_modules_directly_imported_by(module):
            target = wing(imported) if imported.startswith("marketplace.") else None
            if target is not None and target != importer:
                imports[importer].add(target)
    return imports


def cycle(imports: dict[str, set[str]]) -> list[str]:
    """One cycle between wings, or [] when they have none."""
    try:
        TopologicalSorter(imports).prepare()
    except CycleError as error:
        return list(error.args[1])
    return []


@pytest.fixture(scope="module")
def imports() -> dict[str, set[str]]:
    return wing_imports(grimp.build_graph("marketplace", exclude_type_checking_imports=True))


class WingTests:
    def test_it_finds_a_cycle_where_there_is_one(self) -> None:
        graph = grimp.ImportGraph()
        for importer, imported in (
            ("marketplace.a.x", "marketplace.b.y"),
            ("marketplace.b.z", "marketplace.a.w"),
            ("marketplace.tests.t", "marketplace.a.x"),
        ):
            graph.add_import(importer=importer, imported=imported)
        assert sorted(set(cycle(wing_imports(graph)))) == ["marketplace.a", "marketplace.b"]

    def test_the_wings_have_no_cycle(self, imports: dict[str, set[str]]) -> None:
        assert cycle(imports) == []

    def test_the_wings_import_downwards(self, imports: dict[str, set[str]]) -> None:
        """(the graph is not empty: the doors reach the lifecycle through the write API, and the
        lifecycle reads trust)"""
        assert "marketplace.services" in imports["marketplace.openai"] & imports["marketplace.hostdoor"]
        assert "marketplace.trust" in imports["marketplace.lifecycle"]
        assert "marketplace.lifecycle" not in imports["marketplace.trust"]
