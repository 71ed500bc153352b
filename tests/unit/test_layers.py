"""Imports point down the layers of ``pipeline/layers.py``, never up."""

from __future__ import annotations

import ast
from pathlib import Path

from pipeline.layers import LAYERS, layer_of

ROOT = Path(__file__).resolve().parents[2]


def _modules() -> dict[str, Path]:
    out = {}
    for package in ("pipeline", "connectors"):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import of rlstream's own packages in ``path``,
    function-level and ``TYPE_CHECKING`` imports included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
    return [(n, m) for n, m in found if m.split(".")[0] in ("pipeline", "connectors")]


def test_every_module_has_a_layer_and_imports_only_its_own_or_lower_layers() -> None:
    modules = _modules()
    assert len(modules) > 100
    unplaced = sorted(m for m in modules if layer_of(m) is None)
    assert not unplaced, f"place these modules in pipeline/layers.py: {unplaced}"
    against = []
    for module, path in modules.items():
        mine = layer_of(module)
        assert mine is not None
        for line, imported in _imports(path):
            theirs = layer_of(imported)
            if theirs is None or theirs > mine:
                against.append(
                    f"{path.relative_to(ROOT)}:{line} ({module}, layer {mine}) imports "
                    f"{imported} (layer {theirs})"
                )
    assert not against, "imports against pipeline/layers.py:\n" + "\n".join(against)


def test_the_check_fails_on_an_import_up_the_layers() -> None:
    """The rule itself: the kafka layer importing the trainer is refused, the trainer
    importing kafka is not (so the test above can fail)."""
    kafka, train = layer_of("pipeline.kafka.transport"), layer_of("pipeline.train.trainer")
    assert kafka is not None and train is not None and kafka < train
    assert layer_of("pipeline.observe.telemetry") == 1
    assert layer_of("pipeline.observe.report") == layer_of("pipeline.observe")
    assert layer_of("pipeline") == 0 and layer_of("pipelinex") is None
    assert len({n for names in LAYERS for n in names}) == sum(map(len, LAYERS))
