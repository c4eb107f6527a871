"""The checkpoint engine's four layers, read from its source: each folder imports only the
layers below it, and no import chain inside the engine is long.

    storage/  (where bytes live)
      <- format/  (what bytes mean)
        <- pipeline/  (save and restore as stages, multi-process)
          <- manager/  (CheckpointManager, its policies)
            <- the package's top level (the flax-compatible calls, options, the plan)

`checkpoints/_errors.py` is the ground every layer stands on: it imports nothing of the
engine. Imports under `if TYPE_CHECKING` count too: a layer that must name an upper layer's
type to annotate itself is built upside down.
"""

from __future__ import annotations

import functools

from test_import_graph import _edges, _modules

ENGINE = "eqx_train.checkpoints"
LAYERS = ("storage", "format", "pipeline", "manager")
GROUND = f"{ENGINE}._errors"
TOP = len(LAYERS)


def _layer(module: str) -> int | None:
    """The layer of an engine module (0 storage ... 3 manager, 4 the top level), or None
    for the ground and for modules outside the engine."""
    if module == GROUND or not (module == ENGINE or module.startswith(ENGINE + ".")):
        return None
    parts = module[len(ENGINE) + 1 :].split(".")
    return LAYERS.index(parts[0]) if parts[0] in LAYERS else TOP


def _engine_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    inside = {m for m in graph if m == ENGINE or m.startswith(ENGINE + ".")}
    return {m: graph[m] & inside for m in inside}


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, imported in sorted(graph.items()):
        for other in sorted(imported):
            if module == GROUND:
                found.append(f"{module} imports {other}: the ground imports no layer")
                continue
            here, there = _layer(module), _layer(other)
            if here is not None and there is not None and there > here:
                found.append(f"{module} ({_name(here)}) imports {other} ({_name(there)})")
    return found


def _name(layer: int) -> str:
    return LAYERS[layer] if layer < TOP else "top level"


def _longest_chain(graph: dict[str, set[str]]) -> list[str]:
    """The longest path of imports (the graph has no cycle: another test says so)."""

    @functools.cache
    def longest_from(module: str) -> tuple[str, ...]:
        tails = [longest_from(other) for other in graph.get(module, ())]
        return (module, *max(tails, key=len, default=()))

    return list(max((longest_from(m) for m in graph), key=len, default=()))


# Issue 36's bound. The floor of this design: the package, the manager (or a public call),
# a pipeline orchestrator, a stage, a reader or writer, the tree description or a header
# codec, the ground.
MAX_CHAIN_IMPORTS = 6


def test_every_engine_module_lives_in_a_layer_or_the_top_level():
    graph = _engine_graph(_edges(_modules()))
    layered = {LAYERS[layer] for m in graph if (layer := _layer(m)) is not None and layer < TOP}
    assert layered == set(LAYERS)
    assert GROUND in graph


def test_the_checkpoint_layers_import_only_downward():
    graph = _engine_graph(_edges(_modules()))
    assert _upward_imports(graph) == []


def test_no_import_chain_inside_the_engine_is_longer_than_six_imports():
    graph = _engine_graph(_edges(_modules()))
    chain = _longest_chain(graph)
    assert len(chain) - 1 <= MAX_CHAIN_IMPORTS, " -> ".join(chain)


def test_the_layer_checks_can_fail():
    """A planted upward import, an import into the ground and a long chain are all found."""
    s, f, p = f"{ENGINE}.storage._s", f"{ENGINE}.format._f", f"{ENGINE}.pipeline._p"
    graph = {s: {f}, f: {GROUND}, p: {f}, GROUND: {p}}
    assert _upward_imports(graph) == [
        f"{ENGINE}._errors imports {p}: the ground imports no layer",
        f"{s} (storage) imports {f} (format)",
    ]
    chain = {f"m{i}": {f"m{i + 1}"} for i in range(8)}
    assert _longest_chain(chain) == [f"m{i}" for i in range(9)]
