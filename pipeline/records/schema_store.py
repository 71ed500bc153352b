"""The Avro schemas shipped with rlstream, parsed and indexed by fingerprint.

The ``.avsc`` files live in the top-level ``schemas/`` folder of the source tree and are
installed as the package ``pipeline.schemas``, so an installed wheel finds them without
the source tree. Writers identify their schema by its CRC-64-AVRO fingerprint (Avro
single-object encoding); a :class:`SchemaStore` maps fingerprints back to schemas.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

from fastavro.schema import fingerprint as _fingerprint
from fastavro.schema import parse_schema, to_parsing_canonical_form

from pipeline.errors import RecordDecodeError, RegistryUnavailableError
from pipeline.records.registry import RegistryError, SchemaRegistry, UnusableSchemaIdError

#: Schema files in dependency order (a file may use named types of the ones before it).
SCHEMA_FILES = (
    "Tensor",
    "Trajectory",
    "RecordedTrajectory",
    "WeightsAnnouncement",
    "WeightsChunk",
    "DeadLetter",
    "Telemetry",
    "ProducerHeartbeat",
)
#: Earlier versions of shipped schemas, which records and recordings may still carry:
#: known as writer schemas, read into the current version by Avro's resolution rules.
HISTORY_FILES = ("Trajectory.v1", "WeightsAnnouncement.v1")


@dataclass(frozen=True)
class Schema:
    """One parsed writer or reader schema."""

    name: str
    parsed: Any
    fingerprint: bytes
    #: The schema as a standalone JSON document, with docs and defaults (what a schema
    #: registry is given: its compatibility checks need the defaults).
    text: str = ""

    @property
    def canonical_form(self) -> str:
        return str(to_parsing_canonical_form(self.parsed))


def schema_fingerprint(parsed: Any) -> bytes:
    """CRC-64-AVRO fingerprint of the schema's parsing canonical form, as written on the
    wire (8 bytes, little-endian)."""
    return bytes.fromhex(_fingerprint(to_parsing_canonical_form(parsed), "CRC-64-AVRO"))


def load_schema_json(name: str) -> dict[str, Any]:
    """The JSON of a shipped ``.avsc`` file, e.g. ``load_schema_json("Trajectory")``."""
    text = resources.files("pipeline.schemas").joinpath(f"{name}.avsc").read_text("utf-8")
    return dict(json.loads(text))


def parse(schema_json: Mapping[str, Any], named: dict[str, Any] | None = None) -> Schema:
    """Parse a schema (resolving named types in ``named``) into a :class:`Schema`."""
    named = {} if named is None else named
    parsed: Any = parse_schema(dict(schema_json), named_schemas=named)
    text = json.dumps(schema_json, separators=(",", ":"))
    return Schema(str(parsed["name"]), parsed, schema_fingerprint(parsed), text)


def expand_references(schema_json: Any, definitions: Mapping[str, Any]) -> Any:
    """``schema_json`` with each named type it uses from ``definitions`` (full name to
    JSON) written out in full at its first use, so that the schema stands alone and its
    canonical form and fingerprint are those any Avro implementation computes."""
    defined: set[str] = set()

    def walk(node: Any, namespace: str) -> Any:
        if isinstance(node, str):
            full = node if "." in node else f"{namespace}.{node}"
            if full in definitions and full not in defined:
                defined.add(full)
                return walk(copy.deepcopy(definitions[full]), namespace)
            return node
        if isinstance(node, list):
            return [walk(n, namespace) for n in node]
        if not isinstance(node, dict):
            return node
        node = dict(node)
        if node.get("type") in ("record", "enum", "fixed") and "name" in node:
            namespace = node.get("namespace", namespace)
            name = node["name"]
            defined.add(name if "." in name else f"{namespace}.{name}")
        for key in ("type", "items", "values"):
            if key in node and not (
                key == "type" and isinstance(node[key], str) and node[key] in _AVRO_KINDS
            ):
                node[key] = walk(node[key], namespace)
        if "fields" in node:
            node["fields"] = [dict(f, type=walk(f["type"], namespace)) for f in node["fields"]]
        return node

    return walk(schema_json, str(schema_json.get("namespace", "")))


_AVRO_KINDS = frozenset(
    "null boolean int long float double bytes string record enum array map fixed".split()
)


def _builtin() -> tuple[dict[str, Schema], list[Schema]]:
    """The current version of each shipped schema by full name, and the earlier ones."""
    definitions: dict[str, Any] = {}
    out = {}
    for name in SCHEMA_FILES:
        raw = load_schema_json(name)
        schema = parse(expand_references(raw, definitions))
        definitions[schema.name] = raw
        out[schema.name] = schema
    history = [parse(expand_references(load_schema_json(n), definitions)) for n in HISTORY_FILES]
    return out, history


def history(name: str) -> list[Schema]:
    """The earlier shipped versions of record ``name``, oldest first."""
    full = name if "." in name else f"rlstream.{name}"
    return [s for s in _builtin()[1] if s.name == full]


class SchemaStore:
    """Schemas this process can read: the shipped ones plus any registered writer schemas.

    ``reader(name)`` is the schema records are read into; ``writer(fingerprint)`` is the
    schema a record says it was written with.
    """

    def __init__(self) -> None:
        self._readers, older = _builtin()
        self._writers = {s.fingerprint: s for s in [*older, *self._readers.values()]}
        self._registry: SchemaRegistry | None = None
        self._by_id: dict[int, Schema] = {}

    @property
    def registry(self) -> SchemaRegistry | None:
        """The schema registry records framed with a schema id are resolved through
        (``--schema-registry``); None: such records are refused as ``unknown_schema``."""
        return self._registry

    @registry.setter
    def registry(self, registry: SchemaRegistry | None) -> None:
        self._registry = registry
        self._by_id = {}  # ids mean something in one registry only

    def reader(self, name: str) -> Schema:
        full = name if "." in name else f"rlstream.{name}"
        return self._readers[full]

    def writer(self, fingerprint: bytes) -> Schema | None:
        return self._writers.get(fingerprint)

    def writer_by_id(self, schema_id: int) -> Schema:
        """The writer schema of a Confluent-framed record, through the registry (cached).
        Raises :class:`RecordDecodeError` (``unknown_schema``) when there is no registry
        or when it has no such id, and :class:`RegistryUnavailableError` when it does not
        answer (or answers with an error): the record may be valid."""
        schema = self._by_id.get(schema_id)
        if schema is not None:
            return schema
        if self._registry is None:
            raise RecordDecodeError(
                "unknown_schema",
                f"the record is framed for a schema registry (schema id {schema_id}): "
                "read it with --schema-registry URL",
            )
        try:
            text = self._registry.schema_text(schema_id)
        except UnusableSchemaIdError as e:  # answered, never with a schema: refused
            raise RecordDecodeError("unknown_schema", f"schema id {schema_id}: {e}") from None
        except RegistryError as e:
            raise RegistryUnavailableError(f"schema id {schema_id}: {e}") from None
        if text is None:
            raise RecordDecodeError(
                "unknown_schema", f"schema id {schema_id} is not in {self._registry!r}"
            )
        try:
            schema = parse(json.loads(text))
        except Exception as e:  # the registry holds something that is no Avro schema
            raise RecordDecodeError(
                "unknown_schema", f"schema id {schema_id} does not parse: {str(e)[:200]}"
            ) from None
        self._writers.setdefault(schema.fingerprint, schema)
        self._by_id[schema_id] = schema
        return schema

    def register(self, schema: Schema) -> None:
        """Know an extra writer schema (an older or newer version of a record)."""
        self._writers[schema.fingerprint] = schema

    def use_reader(self, schema: Schema) -> None:
        """Read records of ``schema.name`` into ``schema`` (e.g. an older reader version)."""
        self._readers[schema.name] = schema
        self.register(schema)


_DEFAULT_STORE: SchemaStore | None = None


def default_store() -> SchemaStore:
    """The process-wide store of shipped schemas (built once)."""
    global _DEFAULT_STORE
    if _DEFAULT_STORE is None:
        _DEFAULT_STORE = SchemaStore()
    return _DEFAULT_STORE
