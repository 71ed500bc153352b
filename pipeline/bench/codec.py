"""``rlstream bench codec``: encode+decode of one trajectory, records/s, side by side.

Contenders, all on the same 4,096-token trajectory:

- ``rlstream``: :class:`TrajectoryCodec` (single-object Avro, arrays as Tensor bytes,
  with validation on both ends);
- ``pickle``: ``pickle.dumps(protocol=5)`` and ``pickle.loads`` of the same object;
- ``avro_arrays``: fastavro with the arrays as Avro arrays of numbers (the usual way to
  put numbers in Avro), converted from and back to numpy.
"""

from __future__ import annotations

import argparse
import io
import pickle
from typing import Any

import numpy as np
from fastavro import parse_schema, schemaless_reader, schemaless_writer

from pipeline.bench._timing import rates
from pipeline.launch.cluster import Cluster
from pipeline.records.codec import TrajectoryCodec, to_avro_dict
from pipeline.records.schema_store import default_store
from pipeline.testing import make_trajectory

ARRAY_FIELDS = {"tokens": "int", "loss_mask": "int", "logprobs": "float"}


def avro_arrays_schema() -> Any:
    """The Trajectory schema with Tensor fields replaced by Avro arrays of numbers."""
    import json

    schema = json.loads(default_store().reader("Trajectory").canonical_form)
    fields = []
    for f in schema["fields"]:
        if f["name"] in ARRAY_FIELDS:
            f = {"name": f["name"], "type": {"type": "array", "items": ARRAY_FIELDS[f["name"]]}}
        fields.append(f)
    schema["fields"] = fields
    return parse_schema(schema)


def run(args: argparse.Namespace, cluster: Cluster) -> dict[str, Any]:
    t = make_trajectory(args.tokens, rng=np.random.default_rng(0))
    codec = TrajectoryCodec()
    encoded = codec.encode(t)
    pickled = pickle.dumps(t, protocol=5)
    schema = avro_arrays_schema()

    def avro_arrays() -> None:
        d = to_avro_dict(t)
        for name in ARRAY_FIELDS:
            d[name] = getattr(t, name).tolist()
        buf = io.BytesIO()
        schemaless_writer(buf, schema, d)
        buf.seek(0)
        back: Any = schemaless_reader(buf, schema, None)
        for name, dtype in (
            ("tokens", np.int32),
            ("loss_mask", np.uint8),
            ("logprobs", np.float32),
        ):
            back[name] = np.asarray(back[name], dtype=dtype)

    buf = io.BytesIO()
    d = to_avro_dict(t)
    for name in ARRAY_FIELDS:
        d[name] = getattr(t, name).tolist()
    schemaless_writer(buf, schema, d)

    r = rates(
        {
            "rlstream": lambda: codec.decode(codec.encode(t)),
            "pickle": lambda: pickle.loads(pickle.dumps(t, protocol=5)),
            "avro_arrays": avro_arrays,
        },
        args.seconds or 2.0,
        args.rounds,
    )
    return {
        "bench": "codec",
        "figures": {
            "tokens": args.tokens,
            "rlstream_records_per_s": r["rlstream"],
            "pickle_records_per_s": r["pickle"],
            "avro_arrays_records_per_s": r["avro_arrays"],
            "rlstream_us_per_record": 1e6 / r["rlstream"],
            "rlstream_bytes": len(encoded),
            "pickle_bytes": len(pickled),
            "avro_arrays_bytes": len(buf.getvalue()),
        },
        "ratios": {
            "vs_pickle": r["rlstream"] / r["pickle"],
            "vs_avro_arrays": r["rlstream"] / r["avro_arrays"],
        },
        "goals": {"vs_pickle": ">= 1.5", "vs_avro_arrays": ">= 100"},
    }
