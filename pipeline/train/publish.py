"""Publishing a policy version: its parameters saved where producers load them, announced
on ``<ns>.weights``, and old versions pruned.

This is the last step of the trainer's durability order (ledger, checkpoint, offsets,
then this): a producer never hears of a version whose checkpoint is not durable.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.kafka.weights import announce, announcement
from pipeline.policy.checkpoint import save_params
from pipeline.train.config import TrainerConfig

log = logging.getLogger(__name__)


class WeightsPublisher:
    """Saves ``weights/v<N>`` under the run directory and announces it with ``producer``
    (None: saved only, as when training from a recording)."""

    def __init__(
        self, cfg: TrainerConfig, producer: Any, tokenizer_id: str, lead: bool = True
    ) -> None:
        self.cfg = cfg
        self.producer = producer
        self.tokenizer_id = tokenizer_id
        #: in a trainer group every member saves its shards of the parameters; the lead
        #: (member 0) alone writes the version file, announces and prunes
        self.lead = lead

    def publish(self, version: int, step: int, model: Callable[[], Any], m: dict[str, Any]) -> Path:
        """Version ``version`` of the policy (``model()`` builds it, only if its
        parameters are not saved yet), with the step's float metrics in the
        announcement."""
        path = self.cfg.run_dir / "weights" / f"v{version}"
        if not path.exists():
            save_params(path, model(), version, write_version=self.lead)
        metrics = {k: v for k, v in m.items() if isinstance(v, float)}
        if self.producer is not None and self.lead:
            self._announce(path, version, step, metrics)
        if self.lead:
            self._prune()
        return path

    def _announce(self, path: Path, version: int, step: int, metrics: dict[str, float]) -> None:
        record = announcement(
            version, step, path, self.cfg.model, self.tokenizer_id, self.cfg.trainer_id, metrics
        )
        try:
            announce(self.producer, self.cfg.namespace, record, timeout=self.cfg.announce_timeout_s)
        except TimeoutError:
            # the record stays queued in the client and is delivered when the cluster
            # answers again (within the delivery timeout); training goes on meanwhile
            log.warning("announcement of version %d not acknowledged yet", version)

    def _prune(self) -> None:
        keep = self.cfg.keep_checkpoints + self.cfg.max_staleness
        weights = self.cfg.run_dir / "weights"
        versions = sorted(int(p.name[1:]) for p in weights.glob("v*") if p.name[1:].isdigit())
        for v in versions[:-keep]:
            shutil.rmtree(weights / f"v{v}", ignore_errors=True)
