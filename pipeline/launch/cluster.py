"""The cluster a command talks to: an existing one, or the local broker started for it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from pipeline.kafka.client import KafkaConfig, check_access

_CHECKED: list[KafkaConfig] = []


def checked(kafka: KafkaConfig) -> KafkaConfig:
    """``kafka``, once its cluster has answered this process (refused credentials or an
    unreachable cluster fail here, in one sentence, before any work starts)."""
    if kafka not in _CHECKED:
        check_access(kafka)
        _CHECKED.append(kafka)
    return kafka


class Cluster:
    """``kafka`` itself when ``local`` is false; else the local broker in ``data_dir``,
    started if needed and stopped again on exit if this command started it."""

    def __init__(self, kafka: KafkaConfig, *, local: bool, data_dir: Path, port: int) -> None:
        self.kafka = kafka
        self.local = local
        self.data_dir = data_dir
        self.port = port
        self.broker: Any = None
        self.started = False

    def __enter__(self) -> KafkaConfig:
        if not self.local:
            return checked(self.kafka)
        from pipeline.kafka.broker import BrokerConfig, LocalBroker

        self.broker = LocalBroker(BrokerConfig(data_dir=self.data_dir, port=self.port))
        if not self.broker.running():
            print(f"starting local Kafka broker in {self.broker.data_dir} ...", flush=True)
            self.broker.start(stop_with_parent=True)  # not left behind if the run is killed
            self.started = True
        return checked(dataclasses.replace(self.kafka, bootstrap=self.broker.bootstrap))

    def __exit__(self, *exc: object) -> None:
        if self.started:
            self.broker.stop()
