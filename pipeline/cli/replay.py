"""``rlstream replay`` (recordings) and ``rlstream profile`` (one timeline of every process)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pipeline.cli.common import (
    add_json_arg,
    add_kafka_args,
    add_namespace_arg,
    env_default,
    kafka_config,
    print_result,
)
from pipeline.errors import RlstreamError


def register(sub: Any) -> None:
    p = sub.add_parser(
        "replay",
        help="record a namespace's trajectories to an Avro file, inspect them, publish them again",
    )
    p.add_argument(
        "action",
        choices=["record", "inspect", "play"],
        help="record a namespace's topics to a file; inspect a file; play it into a namespace",
    )
    p.add_argument("file", nargs="?", default=None, help="a recording (inspect, play)")
    p.add_argument(
        "--namespace",
        dest="namespace",
        default=env_default("RLSTREAM_NAMESPACE"),
        help="record: the namespace to read; inspect: read it instead of a FILE; "
        "play: the namespace to publish into",
    )
    p.add_argument("--env", default=None, help="record: only these environments (a,b)")
    p.add_argument(
        "--from", dest="start", default=None, help="record: OFFSET, ms:EPOCH_MS or ISO time"
    )
    p.add_argument(
        "--to", dest="end", default=None, help="record: OFFSET, ms:EPOCH_MS or ISO time (exclusive)"
    )
    p.add_argument("-o", "--output", default=None, help="record: the recording to write")
    p.add_argument("--filter", default=None, help="inspect: env=..,status=..,min_reward=..")
    p.add_argument("--ledger", default=None, help="inspect: a run directory (or ledger.jsonl)")
    p.add_argument("--step", type=int, default=None, help="inspect: with --ledger, one step")
    p.add_argument("--limit", type=int, default=None, help="inspect: show at most this many")
    p.add_argument("--rate", type=float, default=None, help="play: records per second")
    p.add_argument(
        "--original-timing", action="store_true", help="play: the recorded spacing in time"
    )
    add_kafka_args(p)
    add_json_arg(p)
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser(
        "profile",
        help="every process's spans on one timeline (Chrome trace / Perfetto) and where "
        "the time went",
    )
    add_namespace_arg(p)
    p.add_argument("-o", "--output", default=None, help="write the trace (JSON) here")
    add_kafka_args(p)
    add_json_arg(p)
    p.set_defaults(func=cmd_profile)


def cmd_replay(args: argparse.Namespace) -> int:
    from pipeline.kafka import replay
    from pipeline.observe import recording

    if args.action == "record":
        if not args.namespace:
            raise RlstreamError("replay record needs --namespace NS")
        if not args.output:
            raise RlstreamError("replay record needs -o FILE.avro")
        envs = [e for e in (args.env or "").split(",") if e]

        def bar(st: Any, total: int) -> None:
            done = st.records
            width = 30
            filled = int(width * done / total) if total else width
            print(
                f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} records "
                f"{st.bytes / 1e6:.1f} MB",
                end="",
                file=sys.stderr,
                flush=True,
            )

        stats = replay.record(
            kafka_config(args),
            args.namespace,
            Path(args.output),
            envs,
            replay.parse_bound(args.start),
            replay.parse_bound(args.end),
            progress=bar,
        )
        print(file=sys.stderr)
        print_result(
            args,
            {
                "figures": {
                    "records": stats.records,
                    "undecodable": stats.undecodable,
                    "bytes_in": stats.bytes,
                    "file_bytes": Path(args.output).stat().st_size,
                },
                "partitions": stats.partitions,
            },
            f"recorded {stats.records} records ({stats.undecodable} undecodable) to "
            f"{args.output} ({Path(args.output).stat().st_size / 1e6:.1f} MB)",
        )
        return 0
    if args.action == "play":
        if not args.file:
            raise RlstreamError("replay play needs a recording FILE")
        if not args.namespace:
            raise RlstreamError("replay play needs --namespace NS2 to publish into")
        n = replay.play(
            Path(args.file),
            kafka_config(args),
            args.namespace,
            rate=args.rate,
            original_timing=args.original_timing,
            progress=lambda i: print(f"published {i}", file=sys.stderr, flush=True),
        )
        print_result(args, {"figures": {"published": n}}, f"published {n} records")
        return 0
    # inspect
    ledger = recording.LedgerIndex.load(Path(args.ledger)) if args.ledger else None
    if ledger is not None and args.step is not None:
        entry = ledger.step(args.step)
        lines = [f"step {entry['step']} (trainer version after it: {entry['version']})"]
        lines.append(f"trained {len(entry['trained'])}:")
        lines += [f"  {tid}  {topic}[{p}]@{o}" for tid, topic, p, o in entry["trained"]]
        lines.append(f"dropped {len(entry['dropped'])}:")
        for tid, topic, p, o, reason in entry["dropped"]:
            where = f"{o[0]}..{o[1] - 1}" if isinstance(o, list) else o
            lines.append(f"  {tid or '-'}  {topic}[{p}]@{where}  {reason}")
        print_result(args, entry, "\n".join(lines))
        if not args.file:
            return 0
    keep = recording.parse_filter(args.filter)
    if args.file:
        records = replay.read_recording(Path(args.file))
    elif args.namespace:
        records = iter(replay.read_namespace(kafka_config(args), args.namespace))
    else:
        raise RlstreamError(
            "replay inspect needs a FILE, --namespace NS or --ledger RUN_DIR --step N"
        )
    shown: list[dict[str, Any]] = []
    damage: str | None = None
    try:
        for r in records:
            if not keep(r):
                continue
            if args.json:
                shown.append(recording.summary_json(r, ledger))
            else:
                print(recording.render(r, ledger), flush=True)
                shown.append({})
            if args.limit and len(shown) >= args.limit:
                break
    except replay.RecordingError as e:
        damage = str(e)
    if args.json:
        print(json.dumps({"records": shown, "count": len(shown), "error": damage}))
    else:
        print(f"{len(shown)} records shown", flush=True)
    if damage:
        print(f"rlstream: error: {damage}", file=sys.stderr)
        return 2
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from pipeline.observe import profile

    telemetry = profile.read(kafka_config(args), args.namespace)
    summary = profile.summarize(telemetry)
    if args.output:
        profile.write_trace(telemetry, Path(args.output))
        print(f"wrote {args.output} ({len(telemetry.spans)} spans)", file=sys.stderr)
    print_result(args, {"profile": summary}, profile.render(summary))
    return 0
