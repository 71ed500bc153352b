"""Publishing a policy version: its parameters saved where producers load them, announced
on ``<ns>.weights``, and old versions pruned. With LoRA a version is its adapters alone
(``format: orbax-lora``), and the base they apply to is saved once as ``weights/base``.

With ``data_producer`` each announced version's files are also sent to the cluster
(:mod:`pipeline.kafka.weights_data`) before it is announced, and the announcement says
where, for producers that cannot read the run directory. Sending and announcing run on a
thread of their own, so training goes on meanwhile (in a trainer group, the other members
never wait on the lead's sending); one version is sent at a time, in order, and
:meth:`WeightsPublisher.close` waits for the last.

This is the last step of the trainer's durability order (ledger, checkpoint, offsets,
then this): a producer never hears of a version whose checkpoint is not durable.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import confluent_kafka

from pipeline.kafka.weights import announce, announcement
from pipeline.kafka.weights_data import send_checkpoint
from pipeline.policy.checkpoint import digest, save_params
from pipeline.policy.lora import save_adapters
from pipeline.train.config import TrainerConfig

log = logging.getLogger(__name__)


class WeightsPublisher:
    """Saves ``weights/v<N>`` under the run directory and announces it with ``producer``
    (None: saved only, as when training from a recording), its files sent to the cluster
    with ``data_producer`` (None: not sent)."""

    def __init__(
        self,
        cfg: TrainerConfig,
        producer: Any,
        tokenizer_id: str,
        lead: bool = True,
        data_producer: Any = None,
    ) -> None:
        self.cfg = cfg
        self.producer = producer
        self.data_producer = data_producer
        self.tokenizer_id = tokenizer_id
        #: in a trainer group every member saves its shards of the parameters; the lead
        #: (member 0) alone writes the version file, announces and prunes
        self.lead = lead
        self._base_digest = ""
        #: where the base lies in the cluster, once sent
        self._base_transfer: dict[str, Any] | None = None
        #: the sending and announcing of the last version published, while it runs
        self._sending: threading.Thread | None = None
        #: set at a stop that could not wait for the sending: it gives up
        self._stop = threading.Event()

    def publish(
        self,
        version: int,
        step: int,
        model: Callable[[], Any],
        m: dict[str, Any],
        adapters: Callable[[], Any] | None = None,
    ) -> Path:
        """Version ``version`` of the policy (``model()`` builds it, only if its
        parameters are not saved yet), with the step's float metrics in the
        announcement. With ``adapters`` the version is what they return, and ``model()``
        is the base they apply to."""
        path = self.cfg.run_dir / "weights" / f"v{version}"
        if not path.exists():
            if adapters is None:
                save_params(path, model(), version, write_version=self.lead)
            else:
                base = self._base(model)
                args = (version, self.cfg.model, self.cfg.lora, base, self._base_digest)
                save_adapters(path, adapters(), *args, write_version=self.lead)
        metrics = {k: v for k, v in m.items() if isinstance(v, float)}
        if self.producer is not None and self.lead:
            fmt = "orbax" if adapters is None else "orbax-lora"
            self.wait()  # the version before is sent and announced first
            self._sending = threading.Thread(
                target=self._announce,
                args=(path, version, step, metrics, fmt),
                name=f"weights-v{version}",
                daemon=True,
            )
            self._sending.start()
        if self.lead:
            self._prune()
        return path

    def _base(self, model: Callable[[], Any]) -> Path:
        """``weights/base``, the parameters adapters apply to, saved the first time."""
        path = self.cfg.run_dir / "weights" / "base"
        if not path.exists():
            save_params(path, model(), 0, write_version=self.lead)
        if self.lead and not self._base_digest:
            self._base_digest = digest(path)
        return path

    def _announce(
        self, path: Path, version: int, step: int, metrics: dict[str, float], fmt: str
    ) -> None:
        try:
            self._send_and_announce(path, version, step, metrics, fmt)
        except Exception:  # the thread ends; training goes on, the next version is sent
            log.exception("version %d was not announced", version)

    def _send_and_announce(
        self, path: Path, version: int, step: int, metrics: dict[str, float], fmt: str
    ) -> None:
        files_digest, transfer, base_transfer = None, None, None
        if self.data_producer is not None:
            try:
                files_digest, transfer = send_checkpoint(
                    self.data_producer, self.cfg.namespace, path, version, stop=self._stop
                )
                if fmt == "orbax-lora":
                    base_transfer = self._sent_base()
            except (TimeoutError, confluent_kafka.KafkaException, OSError) as e:
                log.warning(
                    "the files of version %d were not sent to the cluster (%s): producers "
                    "that cannot read %s keep their weights",
                    version,
                    e,
                    path,
                )
                transfer = base_transfer = None
            if self._stop.is_set():
                return  # the trainer is stopping: the version is in its run directory
        record = announcement(
            version,
            step,
            path,
            self.cfg.model,
            self.tokenizer_id,
            self.cfg.trainer_id,
            metrics,
            files_digest,
        )
        record["format"] = fmt
        record["transfer"] = transfer
        record["base_transfer"] = base_transfer
        try:
            announce(self.producer, self.cfg.namespace, record, timeout=self.cfg.announce_timeout_s)
        except TimeoutError:
            # the record stays queued in the client and is delivered when the cluster
            # answers again (within the delivery timeout); training goes on meanwhile
            log.warning("announcement of version %d not acknowledged yet", version)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the last version published is sent and announced (at most
        ``timeout`` seconds); False if it is not yet."""
        if self._sending is None:
            return True
        self._sending.join(timeout)
        return not self._sending.is_alive()

    def close(self, timeout: float | None = None) -> None:
        """At a stop: the last version's sending and announcement may finish."""
        t0 = time.monotonic()
        if not self.wait(timeout):
            self._stop.set()
            self.wait(2.0)
            log.warning(
                "the last version's weights were not sent and announced within %.0f s",
                time.monotonic() - t0,
            )

    def _sent_base(self) -> dict[str, Any]:
        """Where the base adapters apply to lies in the cluster (sent the first time)."""
        if self._base_transfer is None:
            path = self.cfg.run_dir / "weights" / "base"
            _, self._base_transfer = send_checkpoint(
                self.data_producer, self.cfg.namespace, path, 0, key="base", stop=self._stop
            )
        return self._base_transfer

    def _prune(self) -> None:
        keep = self.cfg.keep_checkpoints + self.cfg.max_staleness
        weights = self.cfg.run_dir / "weights"
        versions = sorted(int(p.name[1:]) for p in weights.glob("v*") if p.name[1:].isdigit())
        for v in versions[:-keep]:
            shutil.rmtree(weights / f"v{v}", ignore_errors=True)
