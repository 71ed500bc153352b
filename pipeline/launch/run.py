"""``rlstream run``: the whole pipeline on one machine, as separate OS processes.

1. topics of a fresh namespace; the initial policy evaluated on held-out episodes;
2. one ``rlstream train`` and N ``rlstream produce`` processes (the same code paths as
   those commands), watched by a :class:`~pipeline.launch.supervisor.Supervisor`, with one live
   progress line;
3. when the trainer reaches ``steps`` (or on Ctrl-C/SIGTERM, or when a child fails),
   every child is stopped, the final policy is evaluated on the same held-out episodes,
   and ``report.md`` with its plots is written.

``sync=True`` runs the classic loop with the same components: each producer generates its
share of one batch with the current policy and waits for the next version; the trainer
trains only on samples of its own version.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from connectors.base import env_name
from pipeline.kafka.client import KafkaConfig
from pipeline.kafka.topics import ensure_topics, namespace_topics
from pipeline.launch import report, warm_start
from pipeline.launch.config import RunConfig
from pipeline.launch.supervisor import Child, Supervisor
from pipeline.observe.report import last_json, mean_over_envs
from pipeline.observe.shipping import kafka_tracer
from pipeline.observe.telemetry import NullTracer, install, span
from pipeline.observe.tensorboard import ScalarWriter
from pipeline.records.schema_store import default_store
from pipeline.settings import to_mapping, write_file
from pipeline.train.members import free_coordinator

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RunResult:
    status: str  # completed | interrupted | failed
    figures: dict[str, Any]
    report: Path
    failure: str = ""


def child_environment(kafka: KafkaConfig) -> dict[str, str]:
    """How children reach the cluster: the same variables a user would set (secrets
    travel in the environment, never on a command line)."""
    sec = kafka.security
    env = {
        "RLSTREAM_BOOTSTRAP": kafka.bootstrap,
        "RLSTREAM_SECURITY_PROTOCOL": sec.protocol,
        "RLSTREAM_DEBUG": "1",  # a child's log keeps the traceback of an unexpected error
    }
    for name, value in (
        ("RLSTREAM_SASL_MECHANISM", sec.sasl_mechanism),
        ("RLSTREAM_SASL_USERNAME", sec.username),
        ("RLSTREAM_SASL_PASSWORD", sec.password),
        ("RLSTREAM_SSL_CA", sec.ssl_ca_location),
    ):
        if value:
            env[name] = value
    registry = default_store().registry
    if registry is not None:
        env["RLSTREAM_SCHEMA_REGISTRY"] = registry.config.url
        if registry.config.username is not None:
            env["RLSTREAM_SCHEMA_REGISTRY_USER"] = registry.config.username
            env["RLSTREAM_SCHEMA_REGISTRY_PASSWORD"] = str(registry.config.password)
    return env


class Run:
    """One run in ``run_dir`` on namespace ``namespace``; see the module docstring."""

    def __init__(
        self,
        cfg: RunConfig,
        kafka: KafkaConfig,
        run_dir: Path,
        namespace: str,
        stop: threading.Event | None = None,
        out: TextIO = sys.stdout,
        live: bool | None = None,
    ) -> None:
        self.cfg = cfg
        self.kafka = kafka
        self.run_dir = run_dir
        self.namespace = namespace
        self.stop = stop or threading.Event()
        self.out = out
        self.live = out.isatty() if live is None else live
        self.start_time = time.time()
        self.display = Display(self, out, self.live)

    # ---- children ----------------------------------------------------------------------

    def config_json(self) -> dict[str, Any]:
        """Every setting of this run (``config.json``; ``--config`` reads it back)."""
        return to_mapping(self.cfg)

    def children(self) -> list[Child]:
        """The trainer and the producers, each started with ``--config`` on its resolved
        configuration in the run directory."""
        cfg, rd = self.cfg, self.run_dir
        kafka_flags = [f"--kafka-option={k}={v}" for k, v in self.kafka.extra.items()]
        env = child_environment(self.kafka)
        configs = rd / "configs"
        coordinator = free_coordinator()
        trainers = []
        for i in range(cfg.trainers):
            name = "trainer" if i == 0 else f"trainer-{i}"
            path = write_file(
                cfg.trainer(self.namespace, rd, i, coordinator), configs / f"{name}.json"
            )
            trainers.append(
                Child(
                    name,
                    ["train", f"--config={path}", *kafka_flags],
                    rd / "logs" / f"{name}.log",
                    env,
                )
            )
        producers = []
        for i in range(cfg.producers):
            name = f"producer-{i}"
            path = write_file(cfg.producer(i, self.namespace, rd), configs / f"{name}.json")
            producers.append(
                Child(
                    name,
                    ["produce", f"--config={path}", *kafka_flags],
                    rd / "logs" / f"{name}.log",
                    env,
                )
            )
        return [*trainers, *producers]

    # ---- the run -----------------------------------------------------------------------

    def say(self, text: str) -> None:
        self.display.clear()
        print(text, file=self.out, flush=True)

    def evaluate(self, which: str) -> dict[str, Any] | None:
        """Held-out success of the initial policy or of the newest announced weights."""
        if self.cfg.eval_episodes == 0:
            return None
        subject = report.subject(self.run_dir)
        with span("evaluate", which=which):
            return report.evaluate(self.run_dir, subject, which, self.say)

    def execute(self) -> RunResult:
        rd = self.run_dir
        rd.mkdir(parents=True, exist_ok=True)
        write_file(self.cfg, rd / "config.json")
        run_info: dict[str, Any] = {
            "namespace": self.namespace,
            "run_dir": str(rd),
            "bootstrap": self.kafka.bootstrap,
            "start_time": self.start_time,
        }
        self._write_info(run_info)
        self.say(f"run directory {rd} namespace {self.namespace}")
        if self.cfg.warm_start.enabled:
            model = warm_start.prepare(
                self.cfg.warm_start,
                self.cfg.env,
                self.cfg.env_options,
                self.cfg.seed,
                rd,
                self.say,
                self.stop,
                child_environment(self.kafka),
            )
            self.cfg = self.cfg.started_from(model)
        ensure_topics(
            self.kafka,
            namespace_topics(
                self.namespace,
                [env_name(self.cfg.env, self.cfg.env_kwargs)],
                self.cfg.partitions,
            ),
        )
        # the run's own spans (its evaluations) go on the timeline with the children's
        tracing = install(kafka_tracer("run", self.kafka, self.namespace))
        try:
            status, failure, evals, run_s = self._run_children()
        finally:
            tracing.close()
            install(NullTracer())
        run_info.update(
            status=status,
            wall_s=round(time.time() - self.start_time, 1),
            pipeline_wall_s=round(run_s, 1),
        )
        self._write_info(run_info)
        self._eval_scalars(evals)
        figures, path = report.build_report(rd, self.kafka, say=self.say)
        return RunResult(status, figures, path, failure)

    def _write_info(self, info: dict[str, Any]) -> None:
        """``run.json``: the namespace, the cluster, the times and how the run ended."""
        (self.run_dir / "run.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")

    def _run_children(self) -> tuple[str, str, dict[str, dict[str, Any] | None], float]:
        """Initial evaluation, the children until the run ends, final evaluation: the
        run's status, what failed, the evaluations, the children's seconds."""
        rd = self.run_dir
        evals: dict[str, dict[str, Any] | None] = {"initial": self.evaluate("initial")}
        children = self.children()
        supervisor = Supervisor(children)
        status, failure = "completed", ""
        launched = time.time()
        self.say(
            f"starting {self.cfg.trainers} trainer(s) and {self.cfg.producers} producer(s) "
            f"({'synchronous' if self.cfg.sync else 'asynchronous'}), logs in {rd / 'logs'}"
        )
        try:
            supervisor.start()
            self._write_processes(children)
            status, failure = self._watch(supervisor)
        finally:
            self.display.clear()
            if any(c.running() for c in children):
                self.say("stopping every process ...")
            supervisor.stop()
            self._write_processes(children)
        run_s = time.time() - launched
        evals["final"] = self.evaluate("final")
        (rd / "eval.json").write_text(json.dumps(evals, indent=2))
        return status, failure, evals, run_s

    def _eval_scalars(self, evals: dict[str, dict[str, Any] | None]) -> None:
        """Held-out success and reward next to the trainer's scalars, at the evaluated
        policy's version (the trainer step that made it)."""
        writer = ScalarWriter(self.run_dir / "tensorboard")
        for result in evals.values():
            if result is not None:
                writer.write(
                    result["version"],
                    {"eval/success": result["success"], "eval/reward": result["reward_mean"]},
                )

    def _write_processes(self, children: list[Child]) -> None:
        """``processes.json``: every child's pid, exit status, restarts and log."""
        rows = [
            {
                "name": c.name,
                "pid": c.pid,
                "returncode": c.poll(),
                "restarts": c.restarts,
                "log": str(c.log_path),
                "command": ["rlstream", *c.args],
            }
            for c in children
        ]
        (self.run_dir / "processes.json").write_text(json.dumps(rows, indent=2))

    def _watch(self, supervisor: Supervisor) -> tuple[str, str]:
        trainer = supervisor.children[0]
        while True:
            if self.stop.is_set():
                return "interrupted", ""
            if trainer.poll() == 0:
                return "completed", ""
            bad = supervisor.failed()
            if bad is not None:
                message = (
                    f"{bad.name} (pid {bad.pid}) exited with status {bad.returncode}; "
                    f"the end of {bad.log_path}:\n{bad.log_tail()}"
                )
                if bad.restarts < self.cfg.restarts:
                    bad.restarts += 1
                    group = supervisor.children[: self.cfg.trainers]
                    if self.cfg.trainers > 1 and bad in group:
                        # one JAX job: the members restart together from the checkpoint
                        self.say(f"{message}\nrestarting the trainer group ({bad.restarts})")
                        supervisor.stop(group, grace_s=10.0)
                        coordinator = f"--coordinator={free_coordinator()}"
                        for c in group:
                            c.args = [
                                *[a for a in c.args if not a.startswith("--coordinator=")],
                                coordinator,
                            ]
                            c.start()
                    else:
                        self.say(f"{message}\nrestarting {bad.name} ({bad.restarts})")
                        bad.start()
                    self._write_processes(supervisor.children)
                    continue
                self.say(message)
                return "failed", message
            self.display.update(supervisor)
            self.stop.wait(0.5)


class Display:
    """One progress line: on a terminal rewritten in place twice a second, otherwise
    printed every ``every_s`` seconds."""

    def __init__(self, run: Run, out: TextIO, live: bool, every_s: float = 10.0) -> None:
        self.run = run
        self.out = out
        self.live = live
        self.every_s = every_s
        self._last_print = 0.0
        self._shown = False
        self._rates: dict[str, tuple[float, int, float]] = {}

    def clear(self) -> None:
        if self.live and self._shown:
            self.out.write("\r\x1b[K")
            self.out.flush()
            self._shown = False

    def line(self, children: list[Child]) -> str:
        rd, cfg = self.run.run_dir, self.run.cfg
        m = last_json(rd / "metrics.jsonl")
        elapsed = time.time() - self.run.start_time
        parts = [f"[{int(elapsed // 60)}m{int(elapsed % 60):02d}s]"]
        if m is not None:
            parts += [
                f"step {m['step']}/{cfg.steps}",
                f"reward {mean_over_envs(m['reward']):.2f}",
                f"success {mean_over_envs(m['success']):.2f}",
                f"staleness {m['staleness_mean']:.1f}",
                f"lag {m['lag']}",
                f"busy {m['busy_share']:.2f}",
            ]
        else:
            parts.append("step 0 (compiling, waiting for the first batch)")
        total_rate, versions = 0.0, []
        for c in children[cfg.trainers :]:
            r = last_json(rd / "producers" / f"{c.name}.jsonl")
            if r is None:
                versions.append(f"{c.name}=starting")
                continue
            t0, n0, rate = self._rates.get(c.name, (r["time"], r["episodes"], 0.0))
            if r["time"] - t0 >= 2.0:
                rate = (r["episodes"] - n0) / (r["time"] - t0)
                t0, n0 = r["time"], r["episodes"]
            self._rates[c.name] = (t0, n0, rate)
            total_rate += rate
            state = " waiting" if r.get("waiting") else " paused" if r.get("paused") else ""
            share = f" {r.get('in_flight', 0)}/{r['budget_share']}" if r.get("budget_share") else ""
            versions.append(f"{c.name}=v{r['version']}{share}{state}")
        parts += [
            f"{total_rate:.0f} traj/s",
            "producers (version in-flight/share) " + " ".join(versions),
        ]
        return " | ".join(parts)

    def update(self, supervisor: Supervisor) -> None:
        now = time.monotonic()
        if not self.live and now - self._last_print < self.every_s:
            return
        self._last_print = now
        text = self.line(supervisor.children)
        if self.live:
            self.out.write("\r\x1b[K" + text[: os.get_terminal_size(self.out.fileno()).columns - 1])
            self._shown = True
        else:
            self.out.write(text + "\n")
        self.out.flush()
