"""The ``rlstream`` command line: one entry point, one sub-command per job.

Flags that name a cluster or a namespace default to environment variables, shown in
``--help``. Every long-running command prints progress and stops cleanly on SIGINT or
SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pipeline.errors import RlstreamError
from pipeline.kafka import KafkaConfig, SecurityConfig, check_access

log = logging.getLogger("rlstream")


def env_default(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


def add_kafka_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Kafka cluster")
    g.add_argument(
        "--bootstrap",
        default=env_default("RLSTREAM_BOOTSTRAP"),
        help="bootstrap servers host:port[,...] of an existing cluster "
        "(env RLSTREAM_BOOTSTRAP; default: the local broker)",
    )
    g.add_argument(
        "--security-protocol",
        default=env_default("RLSTREAM_SECURITY_PROTOCOL", "PLAINTEXT"),
        choices=["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"],
        help="(env RLSTREAM_SECURITY_PROTOCOL; default %(default)s)",
    )
    g.add_argument(
        "--sasl-mechanism",
        default=env_default("RLSTREAM_SASL_MECHANISM"),
        help="e.g. SCRAM-SHA-512 (env RLSTREAM_SASL_MECHANISM)",
    )
    g.add_argument(
        "--sasl-username",
        default=env_default("RLSTREAM_SASL_USERNAME"),
        help="(env RLSTREAM_SASL_USERNAME)",
    )
    g.add_argument(
        "--sasl-password",
        default=env_default("RLSTREAM_SASL_PASSWORD"),
        help="(env RLSTREAM_SASL_PASSWORD; prefer the variable to the flag)",
    )
    g.add_argument(
        "--ssl-ca",
        default=env_default("RLSTREAM_SSL_CA"),
        help="CA certificate file (env RLSTREAM_SSL_CA)",
    )
    g.add_argument(
        "--kafka-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any librdkafka setting, passed through (repeatable)",
    )


def add_observability_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-telemetry",
        action="store_true",
        help="do not send spans and metrics to <ns>.telemetry",
    )
    add_metrics_args(p, "serve Prometheus metrics on this port (0: any free port)")


def add_metrics_args(p: argparse.ArgumentParser, port_help: str) -> None:
    p.add_argument("--metrics-port", type=int, default=None, help=port_help)
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address the metrics port binds (0.0.0.0 for a Prometheus on another host)",
    )


def add_namespace_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--namespace",
        default=env_default("RLSTREAM_NAMESPACE", "rlstream"),
        help="experiment namespace (env RLSTREAM_NAMESPACE; default %(default)s)",
    )


def add_json_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--json", action="store_true", help="print one JSON object as the last line of output"
    )


def add_broker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--data-dir",
        type=Path,
        default=Path(env_default("RLSTREAM_BROKER_DIR", ".rlstream/broker") or ""),
        help="local broker state and logs (env RLSTREAM_BROKER_DIR; default %(default)s)",
    )
    p.add_argument(
        "--port",
        type=int,
        default=int(env_default("RLSTREAM_BROKER_PORT", "9092") or 9092),
        help="first client port; node i uses port+2i, its controller port+2i+1 "
        "(env RLSTREAM_BROKER_PORT; default %(default)s)",
    )


def add_env_option_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--env-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment constructor option, VALUE read as JSON if it parses "
        "(e.g. high=4, max_turns=6; repeatable)",
    )


def kafka_config(args: argparse.Namespace, bootstrap: str | None = None) -> KafkaConfig:
    extra = {}
    for item in args.kafka_option:
        key, sep, value = item.partition("=")
        if not sep:
            raise RlstreamError(f"--kafka-option {item!r} is not KEY=VALUE")
        extra[key] = value
    security = SecurityConfig(
        protocol=args.security_protocol,
        sasl_mechanism=args.sasl_mechanism,
        username=args.sasl_username,
        password=args.sasl_password,
        ssl_ca_location=args.ssl_ca,
    )
    kafka = KafkaConfig(
        bootstrap=bootstrap or args.bootstrap or "127.0.0.1:9092", security=security, extra=extra
    )
    if kafka not in _CHECKED:  # once per process: refused credentials fail here, clearly
        check_access(kafka)
        _CHECKED.append(kafka)
    return kafka


_CHECKED: list[KafkaConfig] = []


class Cluster:
    """The cluster a command talks to: ``--bootstrap`` if given, else the local broker,
    started if needed and stopped again on exit if this command started it."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.broker: Any = None
        self.started = False

    def __enter__(self) -> KafkaConfig:
        if self.args.bootstrap:
            return kafka_config(self.args)
        from pipeline.broker import BrokerConfig, LocalBroker

        self.broker = LocalBroker(BrokerConfig(data_dir=self.args.data_dir, port=self.args.port))
        if not self.broker.running():
            print(f"starting local Kafka broker in {self.broker.data_dir} ...", flush=True)
            self.broker.start()
            self.started = True
        return kafka_config(self.args, self.broker.bootstrap)

    def __exit__(self, *exc: object) -> None:
        if self.started:
            self.broker.stop()


def print_result(args: argparse.Namespace, result: dict[str, Any], text: str) -> None:
    print(text, flush=True)
    if getattr(args, "json", False):
        print(json.dumps(result, sort_keys=True), flush=True)


class StopFlag:
    """Set by SIGINT/SIGTERM; long-running loops check it and wind down cleanly."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal: int | None = None

    def install(self) -> StopFlag:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.event.is_set():  # second signal: stop now
            raise KeyboardInterrupt
        self.signal = signum
        self.event.set()
        print(f"\nstopping ({signal.Signals(signum).name}); again to force", file=sys.stderr)

    def __bool__(self) -> bool:
        return self.event.is_set()


def start_metrics(args: argparse.Namespace, collect: Any, process: str) -> Any:
    """A Prometheus exporter of ``collect`` when --metrics-port is given (else None)."""
    if args.metrics_port is None:
        return None
    from pipeline.prometheus import Exporter

    exporter = Exporter(collect, args.metrics_port, args.metrics_host, {"process": process})
    print(f"metrics on {exporter.url}", flush=True)
    return exporter.start()


def start_telemetry(args: argparse.Namespace, kafka: KafkaConfig | None, process: str) -> Any:
    """This process's tracer, shipping spans to ``<ns>.telemetry`` unless --no-telemetry
    (or there is no Kafka, e.g. training from a file)."""
    from pipeline.telemetry import NullTracer, Tracer, install

    if getattr(args, "no_telemetry", False) or kafka is None:
        return NullTracer()
    return install(Tracer(process, kafka, args.namespace))


# ---- commands ---------------------------------------------------------------------------


def cmd_broker(args: argparse.Namespace) -> int:
    from pipeline.broker import BrokerConfig, LocalBroker

    password = args.broker_sasl_password or os.environ.get("RLSTREAM_SASL_PASSWORD")
    broker = LocalBroker(
        BrokerConfig(
            data_dir=args.data_dir,
            nodes=args.nodes,
            port=args.port,
            sasl_username=args.broker_sasl_username,
            sasl_password=password if args.broker_sasl_username else None,
        )
    )
    if args.action == "start":
        was_running = broker.running()
        state = broker.start()
        word = "already running" if was_running else "started"
        pids = ",".join(str(n["pid"]) for n in state["nodes"])
        print_result(
            args,
            {
                "bootstrap": state["bootstrap"],
                "security_protocol": state.get("security_protocol", "PLAINTEXT"),
                "nodes": state["nodes"],
                "already_running": was_running,
            },
            f"broker {word} bootstrap={state['bootstrap']} nodes={len(state['nodes'])} "
            f"security={state.get('security_protocol', 'PLAINTEXT')} pids={pids} "
            f"data_dir={broker.data_dir}",
        )
        return 0
    if args.action == "stop":
        stopped = broker.stop()
        print_result(
            args, {"stopped": stopped}, "broker stopped" if stopped else "broker was not running"
        )
        return 0
    status = broker.status()
    if not status["running"]:
        print_result(args, status, f"broker not running (data_dir={status['data_dir']})")
        return 3
    print_result(
        args,
        status,
        f"broker running bootstrap={status['bootstrap']} "
        f"answering={status['answering']} nodes={len(status['nodes'])}",
    )
    return 0


def cmd_topics(args: argparse.Namespace) -> int:
    from pipeline.topics import ensure_topics, namespace_topics

    envs = [e.strip() for e in args.envs.split(",") if e.strip()]
    specs = namespace_topics(args.namespace, envs, args.partitions, replication=args.replication)
    states = ensure_topics(kafka_config(args), specs)
    lines = [
        f"{s.action:8} {s.name} partitions={s.partitions} replication={s.replication} "
        + " ".join(f"{k}={v}" for k, v in sorted(s.config.items()))
        for s in states
    ]
    print_result(
        args,
        {"topics": [s.__dict__ | {"config": dict(s.config)} for s in states]},
        "\n".join(lines),
    )
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from pipeline.smoke import run_round_trip

    return run_round_trip(args)


def cmd_run(args: argparse.Namespace) -> int:
    from pipeline.run import Run, RunConfig

    cfg = RunConfig(
        env=args.env,
        env_options=tuple(args.env_option),
        producers=args.producers,
        concurrency=args.concurrency,
        steps=args.steps,
        sync=args.sync,
        model=args.model,
        group_size=args.group_size,
        groups_per_batch=args.groups_per_batch,
        max_new_tokens=args.max_new_tokens,
        max_staleness=args.max_staleness,
        learning_rate=args.learning_rate,
        latency_ms=args.latency_ms,
        latency_sigma=args.latency_sigma,
        partitions=args.partitions,
        eval_episodes=args.eval_episodes,
        seed=args.seed,
        restarts=3 if args.restart_on_failure else 0,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
    )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    namespace = args.namespace or f"run-{stamp}-{os.getpid() % 10000}"
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / namespace
    stop = StopFlag().install()
    with Cluster(args) as kafka:
        result = Run(cfg, kafka, run_dir, namespace, stop.event).execute()
    f = result.figures
    text = (
        f"run {result.status}: {f['steps']} steps in {f['wall_s']:.0f}s; "
        f"success on {cfg.eval_episodes} held-out episodes: initial "
        f"{_pct(f['success_initial'])} -> final {_pct(f['success_final'])}; "
        f"trained {f['trajectories_trained']} trajectories, dropped as stale "
        f"{f['trajectories_dropped_stale']}\nreport: {result.report}"
    )
    print_result(args, {"status": result.status, "run_dir": str(run_dir), "figures": f}, text)
    if result.status == "failed":
        return 1
    return 130 if result.status == "interrupted" else 0


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def cmd_eval(args: argparse.Namespace) -> int:
    from connectors.base import parse_options
    from pipeline.evaluate import evaluate_weights
    from pipeline.model import PRESETS

    r = evaluate_weights(
        args.env,
        env_options=parse_options(args.env_option),
        model=PRESETS[args.model],
        weights=Path(args.weights) if args.weights else None,
        model_seed=args.model_seed,
        episodes=args.episodes,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
    )
    print_result(
        args,
        {"figures": r.to_json()},
        f"{args.weights or 'initial policy'}: success {_pct(r.success)} "
        f"reward {r.reward_mean:.3f} on {r.episodes} held-out episodes of {args.env}",
    )
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from pipeline import profile

    telemetry = profile.read(kafka_config(args), args.namespace)
    summary = profile.summarize(telemetry)
    if args.output:
        profile.write_trace(telemetry, Path(args.output))
        print(f"wrote {args.output} ({len(telemetry.spans)} spans)", file=sys.stderr)
    print_result(args, {"profile": summary}, profile.render(summary))
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    import asyncio

    from connectors.base import parse_options, registered
    from connectors.serve import SessionHost, serve_http, serve_stdio

    if args.action == "list":
        for name in registered():
            print(name)
        return 0
    if not args.name:
        raise RlstreamError("env serve needs the environment's NAME")
    host = SessionHost(
        args.name,
        parse_options(args.env_option),
        max_sessions=args.max_sessions,
        session_ttl_s=args.session_ttl,
        call_timeout_s=args.call_timeout,
        max_session_bytes=args.max_session_bytes,
        max_total_bytes=args.max_total_bytes,
    )
    if not args.stdio and args.host not in ("127.0.0.1", "::1", "localhost"):
        log.warning(
            "serving on %s: anyone who can reach it can open sessions (there is no "
            "authentication); put it behind a proxy that authenticates",
            args.host,
        )

    async def main() -> None:
        loop = asyncio.get_running_loop()
        serving = asyncio.ensure_future(
            serve_stdio(host) if args.stdio else serve_http(host, args.host, args.port)
        )
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, serving.cancel)
        try:
            await serving
        except asyncio.CancelledError:
            pass

    asyncio.run(main())
    if not args.stdio:
        print(f"served {host.requests} requests", flush=True)
    return 0


def cmd_produce(args: argparse.Namespace) -> int:
    from connectors import stats as connector_stats
    from connectors.base import LatencyModel, env_name, parse_options
    from pipeline.episode import EpisodeLimits
    from pipeline.model import PRESETS
    from pipeline.producer import AdmissionConfig, ProducerConfig, RolloutProducer
    from pipeline.sampler import SamplingConfig
    from pipeline.topics import ensure_topics, namespace_topics

    options = parse_options(args.env_option)
    if args.latency_ms > 0:
        options["latency"] = LatencyModel(args.latency_ms / 1000, args.latency_sigma)
    cfg = ProducerConfig(
        namespace=args.namespace,
        env=args.env,
        env_options=options,
        concurrency=args.concurrency,
        group_size=args.group_size,
        seed=args.seed,
        model_seed=args.model_seed,
        sync_batch=args.sync_batch,
        max_episodes=args.max_episodes,
        grace_s=args.grace_s,
        stop_sequences=tuple(args.stop),
        checkpoint_roots=tuple(Path(r) for r in args.checkpoint_root),
        limits=EpisodeLimits(max_new_tokens=args.max_new_tokens),
        sampling=SamplingConfig(args.temperature, args.top_p, args.seed),
        model=PRESETS[args.model],
        admission=AdmissionConfig(args.max_staleness, args.trainer_batch),
        **({"producer_id": args.producer_id} if args.producer_id else {}),
    )
    kafka = kafka_config(args)
    topic_env = env_name(args.env, options)
    ensure_topics(kafka, namespace_topics(args.namespace, [topic_env], args.partitions))
    stop = StopFlag().install()
    start = time.monotonic()

    status_file = Path(args.status_file) if args.status_file else None
    if status_file:
        status_file.parent.mkdir(parents=True, exist_ok=True)

    def progress(p: Any) -> None:
        if stop:
            p.stop()
        st = p.stats
        done = sum(st.finished.values())
        rate = done / max(1e-9, time.monotonic() - start)
        if status_file:
            status = {
                "time": time.time(),
                "producer_id": cfg.producer_id,
                "episodes": done,
                "in_flight": st.started - done - st.dropped,
                "paused": st.paused,
                "waiting": st.waiting,
                "lag": st.lag,
                "version": p.version,
                "sent": p.writer.sent,
                "delivered": p.writer.delivered,
                "failed": p.writer.failed,
                "connectors": connector_stats.snapshot(),
            }
            with status_file.open("a") as f:
                f.write(json.dumps(status) + "\n")
        print(
            f"episodes={done} rate={rate:.1f}/s in_flight={st.started - done - st.dropped} "
            f"paused={'yes' if st.paused else 'no'} lag={st.lag} version={p.version} "
            f"sent={p.writer.sent} failed={p.writer.failed}",
            flush=True,
        )

    producer = RolloutProducer(cfg, kafka, on_progress=progress)
    tracing = start_telemetry(args, kafka, cfg.producer_id)
    exporter = start_metrics(args, producer.samples, cfg.producer_id)

    def stop_on_signal() -> None:
        stop.event.wait()
        producer.stop()

    threading.Thread(target=stop_on_signal, daemon=True).start()
    try:
        stats = producer.run()
    finally:
        tracing.close()
        if exporter is not None:
            exporter.close()
    progress(producer)  # the final counts
    result = {
        "producer_id": cfg.producer_id,
        "figures": {
            "episodes": sum(stats.finished.values()),
            "by_status": dict(stats.finished),
            "dropped_in_flight": stats.dropped,
            "sent": producer.writer.sent,
            "delivered": producer.writer.delivered,
            "delivery_failed": producer.writer.failed,
            "policy_version": producer.version,
            "paused_s": stats.paused_s,
            "connectors": connector_stats.snapshot(),
        },
    }
    print_result(args, result, f"producer {cfg.producer_id} done: {result['figures']}")
    return 0


def trainer_config(args: argparse.Namespace) -> Any:
    """A TrainerConfig from ``--config FILE`` (JSON: trainer fields, with ``grpo`` and
    ``model`` objects) overridden by the flags given."""
    from pipeline.grpo import GRPOConfig
    from pipeline.model import PRESETS, ModelConfig
    from pipeline.trainer import TrainerConfig

    raw: dict[str, Any] = json.loads(Path(args.config).read_text()) if args.config else {}
    grpo = GRPOConfig(**raw.pop("grpo", {}))
    model = ModelConfig(**raw.pop("model")) if "model" in raw else PRESETS[args.model]
    for flag in (
        "groups_per_batch",
        "group_size",
        "max_staleness",
        "publish_every",
        "max_steps",
        "seed",
        "step_delay_s",
        "group_timeout_s",
        "batch_timeout_s",
        "instance",
    ):
        value = getattr(args, flag)
        if value is not None:
            raw[flag] = value
    if "buckets" in raw:
        raw["buckets"] = tuple(raw["buckets"])
    try:
        return TrainerConfig(
            namespace=args.namespace, run_dir=Path(args.run_dir), grpo=grpo, model=model, **raw
        )
    except TypeError as e:
        raise RlstreamError(f"bad trainer configuration: {e}") from None


def cmd_train(args: argparse.Namespace) -> int:
    from pipeline.trainer import Trainer

    cfg = trainer_config(args)
    source = None
    if args.from_file:
        from pipeline.replay import RecordingSource

        source = RecordingSource(Path(args.from_file))
        print(f"training from {args.from_file}: {len(source)} records", flush=True)
    stop = StopFlag().install()
    start = time.monotonic()

    first_step: list[int] = []

    def progress(m: dict[str, Any]) -> None:
        first_step.append(m["step"])
        done = m["step"] - first_step[0] + 1
        reward = " ".join(f"{e}={r:.3f}" for e, r in m["reward"].items())
        print(
            f"step={m['step']} version={m['version']} reward[{reward}] loss={m['loss']:.4f} "
            f"staleness={m['staleness_mean']:.2f} lag={m['lag']} "
            f"steps/s={done / max(1e-9, time.monotonic() - start):.2f} "
            f"busy={m['busy_share']:.2f} drops={sum(m['drops'].values())}",
            flush=True,
        )

    trainer = Trainer(cfg, None if source else kafka_config(args), on_step=progress, source=source)

    def stop_on_signal() -> None:
        stop.event.wait()
        trainer.stop()

    threading.Thread(target=stop_on_signal, daemon=True).start()
    tracing = start_telemetry(args, None if source else kafka_config(args), cfg.trainer_id)
    exporter = start_metrics(args, trainer.samples, cfg.trainer_id)
    try:
        step = trainer.run()
    finally:
        tracing.close()
        if exporter is not None:
            exporter.close()
    result = {
        "figures": {
            "steps": step,
            "version": trainer.version,
            "drops": dict(trainer.drops),
            "deadlettered": trainer.deadlettered,
        }
    }
    print_result(args, result, f"trainer {cfg.trainer_id} stopped at step {step}")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from pipeline import replay

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
    ledger = replay.LedgerIndex.load(Path(args.ledger)) if args.ledger else None
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
    keep = replay.parse_filter(args.filter)
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
                shown.append(replay.summary_json(r, ledger))
            else:
                print(replay.render(r, ledger), flush=True)
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


def cmd_bench(args: argparse.Namespace) -> int:
    from pipeline.bench import asyncrl, codec, rollout, telemetry, trainer, transport, weights

    benches: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
        "async": asyncrl.run,
        "codec": codec.run,
        "transport": transport.run,
        "rollout": rollout.run,
        "weights": weights.run,
        "trainer": trainer.run,
        "telemetry": telemetry.run,
    }
    result = benches[args.which](args)
    print_result(args, result, format_bench(result))
    return 0


def format_bench(result: dict[str, Any]) -> str:
    lines = [f"bench {result['bench']}"]
    for section in ("figures", "ratios"):
        for k, v in result.get(section, {}).items():
            lines.append(
                f"  {section[:-1]:6} {k:32} {v:,.4g}"
                if isinstance(v, float)
                else f"  {section[:-1]:6} {k:32} {v}"
            )
    for k, v in result.get("goals", {}).items():
        lines.append(f"  goal   {k:32} {v}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlstream",
        description="Asynchronous RL for LLM agents with Apache Kafka between rollout "
        "producers and trainers.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("broker", help="start, stop or inspect the local Apache Kafka (KRaft)")
    p.add_argument("action", choices=["start", "stop", "status"])
    p.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="1, or 3 for a local cluster with replication 3 and min.insync.replicas 2",
    )
    add_broker_args(p)
    p.add_argument(
        "--sasl-username",
        dest="broker_sasl_username",
        default=None,
        help="start: clients must authenticate with SASL/SCRAM-SHA-512 as this user (set "
        "when the data directory is first formatted)",
    )
    p.add_argument(
        "--sasl-password",
        dest="broker_sasl_password",
        default=None,
        help="its password (env RLSTREAM_SASL_PASSWORD; prefer the variable to the flag)",
    )
    add_json_arg(p)
    p.set_defaults(func=cmd_broker)

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

    p = sub.add_parser(
        "env",
        help="serve a registered environment over the remote protocol (HTTP or stdio), "
        "or list the registered ones",
    )
    p.add_argument("action", choices=["serve", "list"])
    p.add_argument("name", nargs="?", help="registered environment name (serve)")
    add_env_option_arg(p)
    p.add_argument("--port", type=int, default=8765, help="HTTP port (0: any free one)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument(
        "--stdio",
        action="store_true",
        help="JSON lines on stdin/stdout instead of HTTP (a child of the process connector)",
    )
    p.add_argument("--max-sessions", type=int, default=1024, help="open sessions at most")
    p.add_argument(
        "--session-ttl", type=float, default=600.0, help="close sessions idle this long (s)"
    )
    p.add_argument(
        "--call-timeout", type=float, default=60.0, help="fail an environment call after (s)"
    )
    p.add_argument(
        "--max-session-bytes",
        type=int,
        default=256 * 1024,
        help="bytes one session may hold (its task, its last answer)",
    )
    p.add_argument(
        "--max-total-bytes",
        type=int,
        default=64 * 1024 * 1024,
        help="bytes all sessions together may hold",
    )
    p.set_defaults(func=cmd_env)

    p = sub.add_parser("topics", help="create a namespace's topics (idempotent)")
    p.add_argument("action", choices=["create"])
    add_namespace_arg(p)
    p.add_argument("--envs", required=True, help="comma-separated environment names")
    p.add_argument("--partitions", type=int, default=4, help="partitions per rollout topic")
    p.add_argument(
        "--replication", type=int, default=None, help="replication factor (default: the broker's)"
    )
    add_kafka_args(p)
    add_json_arg(p)
    p.set_defaults(func=cmd_topics)

    p = sub.add_parser(
        "run",
        help="the main job: the whole pipeline (trainer and producers as separate "
        "processes) with live progress, held-out evaluation and a report",
    )
    p.add_argument(
        "--namespace",
        default=env_default("RLSTREAM_NAMESPACE"),
        help="experiment namespace (env RLSTREAM_NAMESPACE; default: a new one per run)",
    )
    p.add_argument("--run-dir", default=None, help="default: runs/<namespace>")
    p.add_argument("--env", default="guess", help="registered environment name")
    add_env_option_arg(p)
    p.add_argument("--producers", type=int, default=1, help="producer processes")
    p.add_argument("--concurrency", type=int, default=128, help="episodes in flight per producer")
    p.add_argument("--steps", type=int, default=200, help="trainer steps")
    p.add_argument(
        "--sync",
        action="store_true",
        help="the classic loop for comparison: each batch generated by the current policy "
        "while the trainer waits",
    )
    p.add_argument("--model", default="tiny", choices=["tiny", "small", "base"])
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--groups-per-batch", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=4, help="tokens per policy turn")
    p.add_argument("--max-staleness", type=int, default=2, help="policy versions")
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--latency-ms", type=float, default=0.0, help="simulated env latency median")
    p.add_argument("--latency-sigma", type=float, default=1.0)
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument(
        "--eval-episodes", type=int, default=200, help="held-out episodes per evaluation"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--restart-on-failure",
        action="store_true",
        help="restart a process that fails (up to 3 times) instead of stopping the run",
    )
    add_metrics_args(
        p, "Prometheus metrics of the trainer on this port, of producer i on the port + 1 + i"
    )
    add_kafka_args(p)
    add_broker_args(p)
    add_json_arg(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser(
        "check",
        help="an end-to-end round trip of synthetic trajectories through Kafka, each "
        "checked on arrival",
    )
    add_namespace_arg(p)
    p.add_argument("--trajectories", type=int, default=2000, help="how many to send")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per trajectory")
    p.add_argument("--partitions", type=int, default=4)
    add_kafka_args(p)
    add_broker_args(p)
    add_json_arg(p)
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("eval", help="success of a policy on held-out episodes (no Kafka)")
    p.add_argument("--env", default="guess")
    add_env_option_arg(p)
    p.add_argument("--weights", default=None, help="a weights/v<N> folder (default: initial)")
    p.add_argument("--model", default="tiny", choices=["tiny", "small", "base"])
    p.add_argument("--model-seed", type=int, default=0, help="seed of the initial parameters")
    p.add_argument("--episodes", type=int, default=200)
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    add_json_arg(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("produce", help="run a rollout producer: concurrent episodes into Kafka")
    add_observability_args(p)
    add_namespace_arg(p)
    p.add_argument("--env", required=True, help="registered environment name (guess, calc)")
    add_env_option_arg(p)
    p.add_argument("--concurrency", type=int, default=64, help="episodes in flight")
    p.add_argument("--group-size", type=int, default=8, help="GRPO group size G")
    p.add_argument("--partitions", type=int, default=4, help="partitions if the topic is new")
    p.add_argument("--max-episodes", type=int, default=None, help="stop after this many")
    p.add_argument("--max-new-tokens", type=int, default=8, help="tokens per policy turn")
    p.add_argument("--model", default="tiny", choices=["tiny", "small", "base"])
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        help="text that ends a policy turn, besides <eos> and </call> (repeatable)",
    )
    p.add_argument("--producer-id", default=None)
    p.add_argument(
        "--model-seed", type=int, default=0, help="seed of the initial parameters (the trainer's)"
    )
    p.add_argument(
        "--sync-batch",
        type=int,
        default=None,
        help="synchronous mode: episodes per policy version, then wait for the next one",
    )
    p.add_argument(
        "--status-file", default=None, help="append one JSON status line per second here"
    )
    p.add_argument(
        "--latency-ms",
        type=float,
        default=0.0,
        help="simulated environment latency, median (log-normal)",
    )
    p.add_argument("--latency-sigma", type=float, default=1.0, help="its log-normal shape")
    p.add_argument(
        "--checkpoint-root",
        action="append",
        default=[r for r in [env_default("RLSTREAM_CHECKPOINT_ROOT")] if r],
        help="accept announced checkpoints only under this folder (repeatable; "
        "env RLSTREAM_CHECKPOINT_ROOT); none: never reload weights",
    )
    p.add_argument(
        "--max-staleness",
        type=int,
        default=4,
        help="pause while the trainer is this many steps behind (-1: never)",
    )
    p.add_argument(
        "--trainer-batch",
        type=int,
        default=64,
        help="trajectories per trainer step, to turn lag into steps",
    )
    p.add_argument(
        "--grace-s",
        type=float,
        default=5.0,
        help="on SIGINT/SIGTERM, seconds in-flight episodes get to finish",
    )
    add_kafka_args(p)
    add_json_arg(p)
    p.set_defaults(func=cmd_produce)

    p = sub.add_parser("train", help="run a trainer: consume, filter, batch, train, publish")
    add_observability_args(p)
    add_namespace_arg(p)
    p.add_argument(
        "--run-dir",
        default=env_default("RLSTREAM_RUN_DIR", "runs/trainer"),
        help="checkpoints, ledger and metrics (env RLSTREAM_RUN_DIR)",
    )
    p.add_argument(
        "--checkpoint-dir", dest="run_dir", default=argparse.SUPPRESS, help="alias of --run-dir"
    )
    p.add_argument("--config", default=None, help="JSON file of trainer settings")
    p.add_argument(
        "--from-file",
        default=None,
        help="train from a recording (rlstream replay record) instead of Kafka: "
        "deterministic, nothing committed or announced",
    )
    p.add_argument("--model", default="tiny", choices=["tiny", "small", "base"])
    p.add_argument("--groups-per-batch", type=int, default=None)
    p.add_argument("--group-size", type=int, default=None)
    p.add_argument("--max-staleness", type=int, default=None)
    p.add_argument("--publish-every", type=int, default=None)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument(
        "--group-timeout-s",
        type=float,
        default=None,
        help="drop a group still incomplete after this long",
    )
    p.add_argument(
        "--batch-timeout-s",
        type=float,
        default=None,
        help="train a partial batch when no full one came for this long",
    )
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--instance",
        default=None,
        help="this trainer's static group member id (default 0); a restart under the same "
        "id resumes at once",
    )
    p.add_argument(
        "--step-delay-s",
        type=float,
        default=None,
        help="sleep after each step (to test a slow trainer)",
    )
    add_kafka_args(p)
    add_json_arg(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "replay",
        help="record a namespace's trajectories to an Avro file, inspect them, publish them again",
    )
    p.add_argument("action", choices=["record", "inspect", "play"])
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

    p = sub.add_parser("bench", help="benchmarks that print ratios measured side by side")
    p.add_argument(
        "which",
        choices=["codec", "transport", "rollout", "weights", "trainer", "async", "telemetry"],
    )
    p.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="time per measurement (codec: 2 per round; rollout: 15 per level; telemetry: "
        "10 per window)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="interleaved rounds per contender (telemetry: pairs of windows)",
    )
    p.add_argument("--tokens", type=int, default=4096, help="tokens per trajectory")
    p.add_argument("--records", type=int, default=3000, help="records (transport)")
    p.add_argument(
        "--latency-ms",
        type=float,
        default=None,
        help="median environment latency (rollout: 50, async: 100)",
    )
    p.add_argument(
        "--latency-sigma",
        type=float,
        default=None,
        help="its log-normal shape (rollout: 1, async: 1.5)",
    )
    p.add_argument("--concurrency", type=int, default=256, help="episodes in flight (async)")
    p.add_argument(
        "--eval-episodes", type=int, default=200, help="held-out episodes per policy (async)"
    )
    p.add_argument("--run-dir", default=None, help="runs of the async bench")
    p.add_argument(
        "--max-staleness",
        type=int,
        default=None,
        help="policy versions (async: 4); with a heavy tail, a group waits for its slowest "
        "episode and is that much older when it is trained",
    )
    p.add_argument("--announcements", type=int, default=10, help="checkpoints (weights)")
    p.add_argument(
        "--steps", type=int, default=None, help="measured train steps (trainer: 20, async: 30)"
    )
    p.add_argument(
        "--interval", type=float, default=1.5, help="seconds between announcements (weights)"
    )
    add_kafka_args(p)
    add_broker_args(p)
    add_json_arg(p)
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    for chatty in ("absl", "jax._src.xla_bridge", "matplotlib"):  # orbax, backends, fonts
        logging.getLogger(chatty).setLevel(logging.WARNING)
    try:
        return int(args.func(args))
    except RlstreamError as e:
        print(f"rlstream: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rlstream: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
