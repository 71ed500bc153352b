"""``rlstream bench codec``: encode+decode of one trajectory, records/s, side by side.

Contenders, all on the same 4,096-token trajectory of 8 turns (and again of 32 turns,
figures suffixed ``_32_turns``):

- ``rlstream``: :class:`TrajectoryCodec` (single-object Avro, arrays as Tensor bytes,
  with validation on both ends), in C where the extension is built (figure ``native``);
- ``rlstream_python``: the same codec and contract in their Python reference;
- ``pickle``: ``pickle.dumps(protocol=5)`` and ``pickle.loads`` of the same object;
- ``fastavro_same_schema``: what a user of fastavro would write for rlstream's own
  Trajectory schema (arrays as Tensor bytes): ``schemaless_writer`` of the record's plain
  Avro value and ``schemaless_reader`` back, each Tensor turned into a numpy view. It
  checks nothing (rlstream checks the record's contract on both ends): the headline ratio,
  ``vs_fastavro_same_schema``, is measured against the competitor a user would pick;
- ``avro_arrays``: fastavro with the arrays as Avro arrays of numbers (the usual way to
  put numbers in Avro), converted from and back to numpy: a schema choice, not a codec.
"""

from __future__ import annotations

import argparse
import io
import json
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
from fastavro import parse_schema, schemaless_reader, schemaless_writer

from pipeline.bench._timing import rates
from pipeline.launch.cluster import Cluster
from pipeline.records.codec import TrajectoryCodec, to_avro_dict
from pipeline.records.schema_store import default_store
from pipeline.records.trajectory import Trajectory
from pipeline.testing import make_trajectory

ARRAY_FIELDS = {
    "tokens": ("int", np.int32),
    "loss_mask": ("int", np.uint8),
    "logprobs": ("float", np.float32),
    "turn_roles": ("int", np.uint8),
    "turn_starts": ("int", np.int32),
    "turn_ends": ("int", np.int32),
    "turn_latency_s": ("double", np.float64),
}


def avro_arrays_schema() -> Any:
    """The Trajectory schema with Tensor fields replaced by Avro arrays of numbers."""
    schema = json.loads(default_store().reader("Trajectory").canonical_form)
    fields = []
    for f in schema["fields"]:
        if f["name"] in ARRAY_FIELDS:
            items = ARRAY_FIELDS[f["name"]][0]
            f = {"name": f["name"], "type": {"type": "array", "items": items}}
        fields.append(f)
    schema["fields"] = fields
    return parse_schema(schema)


def _contenders(t: Trajectory) -> tuple[dict[str, Callable[[], object]], dict[str, int]]:
    codec = TrajectoryCodec()
    python = TrajectoryCodec(native=False)
    schema = avro_arrays_schema()

    def as_arrays() -> dict[str, Any]:
        d = to_avro_dict(t)
        for name in ARRAY_FIELDS:
            d[name] = np.frombuffer(d[name]["data"], ARRAY_FIELDS[name][1]).tolist()
        return d

    def avro_arrays() -> None:
        buf = io.BytesIO()
        schemaless_writer(buf, schema, as_arrays())
        buf.seek(0)
        back: Any = schemaless_reader(buf, schema, None)
        for name, (_, dtype) in ARRAY_FIELDS.items():
            back[name] = np.asarray(back[name], dtype=dtype)

    same = parse_schema(json.loads(default_store().reader("Trajectory").canonical_form))

    def fastavro_same_schema() -> None:
        buf = io.BytesIO()
        schemaless_writer(buf, same, to_avro_dict(t))
        buf.seek(0)
        back: Any = schemaless_reader(buf, same, None)
        for name, (_, dtype) in ARRAY_FIELDS.items():
            back[name] = np.frombuffer(back[name]["data"], dtype)

    buf = io.BytesIO()
    schemaless_writer(buf, same, to_avro_dict(t))
    same_bytes = len(buf.getvalue())
    buf = io.BytesIO()
    schemaless_writer(buf, schema, as_arrays())
    sizes = {
        "fastavro_same_schema": same_bytes,
        "rlstream": len(codec.encode(t)),
        "rlstream_python": len(python.encode(t)),
        "pickle": len(pickle.dumps(t, protocol=5)),
        "avro_arrays": len(buf.getvalue()),
    }
    contenders = {
        "rlstream": lambda: codec.decode(codec.encode(t)),
        "rlstream_python": lambda: python.decode(python.encode(t)),
        "pickle": lambda: pickle.loads(pickle.dumps(t, protocol=5)),
        "fastavro_same_schema": fastavro_same_schema,
        "avro_arrays": avro_arrays,
    }
    return contenders, sizes


def run(args: argparse.Namespace, cluster: Cluster) -> dict[str, Any]:
    figures: dict[str, Any] = {
        "tokens": args.tokens,
        "native": TrajectoryCodec().native,
    }
    ratios: dict[str, float] = {}
    for turns, suffix in ((8, ""), (32, "_32_turns")):
        t = make_trajectory(args.tokens, rng=np.random.default_rng(0), turns=turns)
        contenders, sizes = _contenders(t)
        r = rates(contenders, args.seconds or 2.0, args.rounds)
        for name in contenders:
            figures[f"{name}_records_per_s{suffix}"] = r[name]
            figures[f"{name}_bytes{suffix}"] = sizes[name]
        figures[f"rlstream_us_per_record{suffix}"] = 1e6 / r["rlstream"]
        ratios[f"vs_fastavro_same_schema{suffix}"] = r["rlstream"] / r["fastavro_same_schema"]
        ratios[f"vs_pickle{suffix}"] = r["rlstream"] / r["pickle"]
        ratios[f"vs_avro_arrays{suffix}"] = r["rlstream"] / r["avro_arrays"]
        ratios[f"vs_python{suffix}"] = r["rlstream"] / r["rlstream_python"]
    return {
        "bench": "codec",
        "figures": figures,
        "ratios": ratios,
        "goals": {
            "vs_fastavro_same_schema": ">= 1.5",
            "vs_pickle": ">= 1.5",
            "vs_avro_arrays": ">= 100",
        },
    }
