"""Weights announcements: the trainer says a checkpoint is ready, producers load it.

``announce`` sends a :class:`WeightsAnnouncement` record (key ``policy``) to the
compacted ``<ns>.weights`` topic once a checkpoint is durable. A
:class:`WeightsSubscriber` runs in the background of every producer: at start it reads the
topic to its end and takes the latest announcement, then follows new ones. Each one is
checked (a newer version, the same model configuration and tokenizer, a digest that
matches the files, the version the files themselves name) and restored with orbax on the
subscriber's thread from a private copy made while hashing (what is restored is exactly
what was verified); parameters that are not all finite are refused. The files come from
the announced folder when it lies inside an allowed root and is readable here (a link out
of the allowed roots is refused), or else from the copy the trainer sent to the cluster
(:mod:`pipeline.kafka.weights_data`): ``source`` says which (auto, directory, cluster).
An announcement of LoRA adapters (``format: orbax-lora``) names the base they apply to,
by URI, digest and sending: the base is verified and restored the same way the first
time, kept, and each version after that moves only its adapters. Only then is it handed
over, so sampling never waits for I/O. A refused announcement, a failed restore or any error
while handling one keeps the old weights and the thread, and is logged (one line) and
counted.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import confluent_kafka

from pipeline.errors import InvalidConfigError, RecordDecodeError
from pipeline.kafka.client import KafkaConfig
from pipeline.kafka.topics import weights_topic
from pipeline.kafka.weights_data import Refusal, fetch_checkpoint
from pipeline.observe.telemetry import span
from pipeline.policy.checkpoint import digest, restore_params, saved_version, snapshot
from pipeline.policy.config import ModelConfig, check_weights_source
from pipeline.policy.lora import adapter_meta, merged, restore_adapters
from pipeline.policy.model import all_finite
from pipeline.records.codec import AvroCodec, shared_codec

log = logging.getLogger(__name__)

KEY = b"policy"
#: checkpoint formats: full parameters, or LoRA adapters on a base named inside them
FORMATS = ("orbax", "orbax-lora")
#: announcements of the backlog kept at start, newest tried first
BACKLOG = 8


def announcement(
    version: int,
    step: int,
    path: Path,
    cfg: ModelConfig,
    tokenizer_id: str,
    trainer_id: str,
    metrics: dict[str, float] | None = None,
    files_digest: str | None = None,
) -> dict[str, Any]:
    """The announcement of the checkpoint at ``path`` (its digest is computed here unless
    given as ``files_digest``)."""
    return {
        "policy_version": version,
        "step": step,
        "checkpoint_uri": str(path.absolute()),
        "digest": files_digest or digest(path),
        "format": "orbax",
        "model_config": cfg.to_json(),
        "tokenizer_id": tokenizer_id,
        "created_at_ms": int(time.time() * 1000),
        "trainer_id": trainer_id,
        "metrics": dict(metrics or {}),
        "transfer": None,
        "base_transfer": None,
    }


def announce(
    producer: confluent_kafka.Producer,
    namespace: str,
    record: dict[str, Any],
    timeout: float = 30.0,
) -> None:
    """Send one announcement and wait until the broker has it."""
    topic = weights_topic(namespace)
    codec = shared_codec("WeightsAnnouncement")
    producer.produce(topic, codec.encode(record, codec.framing_for(topic)), KEY)
    if producer.flush(timeout):
        raise TimeoutError("weights announcement not acknowledged")


def checkpoint_path(uri: str, allowed_roots: Sequence[Path]) -> Path:
    """The local path of ``uri`` if it lies inside one of ``allowed_roots`` (after
    resolving ``..`` and links); ValueError with the reason otherwise."""
    parsed = urlparse(uri)
    if parsed.scheme not in ("", "file"):
        raise ValueError(f"unsupported checkpoint URI scheme {parsed.scheme!r}")
    path = Path(parsed.path if parsed.scheme else uri).resolve()
    for root in allowed_roots:
        if path.is_relative_to(root.resolve()):
            return path
    raise ValueError(f"{path} is outside the allowed roots {[str(r) for r in allowed_roots]}")


class WeightsSubscriber:
    """Follows ``<ns>.weights`` on a background thread and calls
    ``on_weights(params, version)`` for each verified, restored checkpoint."""

    def __init__(
        self,
        kafka: KafkaConfig,
        namespace: str,
        cfg: ModelConfig,
        tokenizer_id: str,
        allowed_roots: Sequence[Path],
        on_weights: Callable[[Any, int], None],
        current_version: int = 0,
        source: str = "auto",
    ) -> None:
        self.kafka = kafka
        self.namespace = namespace
        self.cfg = cfg
        self.tokenizer_id = tokenizer_id
        self.allowed_roots = [Path(r) for r in allowed_roots]
        self.on_weights = on_weights
        self.version = current_version
        check_weights_source(source)
        self.source = source
        self.refused: Counter[str] = Counter()
        self.accepted = 0
        #: versions loaded from each source (directory, cluster)
        self.loaded_from: Counter[str] = Counter()
        self.caught_up = threading.Event()
        self.last_announced_ms = 0
        #: the newest version announced for this model and tokenizer (loaded or not): how
        #: far the trainer is ahead of the weights this producer samples with
        self.announced = current_version
        #: the base LoRA adapters apply to, once loaded: (its digest, its parameters)
        self._base: tuple[str, Any] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weights", daemon=True)

    def start(self) -> WeightsSubscriber:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        codec = AvroCodec("WeightsAnnouncement")
        topic = weights_topic(self.namespace)
        consumer = self.kafka.consumer(None, **{"enable.partition.eof": True})
        consumer.assign(
            [confluent_kafka.TopicPartition(topic, 0, confluent_kafka.OFFSET_BEGINNING)]
        )
        # the backlog's newest announcements, newest last: at the end of the backlog the
        # newest one that loads is taken (an older one only if the newer are refused)
        backlog: deque[dict[str, Any]] = deque(maxlen=BACKLOG)
        try:
            while not self._stop.is_set():
                at_end = False
                for msg in consumer.consume(64, 0.2):
                    err = msg.error()
                    if err is not None:
                        if err.code() == confluent_kafka.KafkaError._PARTITION_EOF:
                            at_end = True
                        else:
                            log.warning("weights consumer error=%s", err.str())
                        continue
                    try:
                        record = codec.decode(msg.value() or b"")
                    except RecordDecodeError as e:
                        self._refuse("undecodable", str(e))
                        continue
                    self._note_announced(record)
                    backlog.append(record)
                # Whatever arrived together (a backlog at start, or the announcements made
                # while a restore ran) is taken newest first: the newest that loads wins.
                if backlog and (at_end or self.caught_up.is_set()):
                    if not self._handle(backlog.pop()):
                        # the newest was refused: it does not count as ahead of us
                        self.announced = self.version
                        while backlog and not self._handle(backlog.pop()):
                            pass
                    backlog.clear()
                if at_end:
                    self.caught_up.set()
        finally:
            consumer.close()

    def _note_announced(self, ann: dict[str, Any]) -> None:
        """Count a version as announced when it is newer and for this policy (same
        tokenizer and model, files this producer can read); one whose restore is refused
        stops counting."""
        try:
            version = int(ann["policy_version"])
            if (
                version > self.announced
                and ann["tokenizer_id"] == self.tokenizer_id
                and ModelConfig.from_json(ann["model_config"]).same_architecture(self.cfg)
            ):
                self._where(ann["checkpoint_uri"], ann.get("transfer"))  # else Refusal
                self.announced = version
        except (KeyError, TypeError, ValueError, InvalidConfigError, Refusal):
            pass  # refused with its reason when handled

    def _refuse(self, reason: str, detail: str) -> None:
        self.refused[reason] += 1
        log.warning("weights refused reason=%s detail=%s", reason, _cut(detail))

    def _handle(self, ann: dict[str, Any]) -> bool:
        """Apply one announcement; whatever goes wrong refuses it (one log line) and
        keeps the thread and the current weights. True if the weights were taken."""
        try:
            return self._apply(ann)
        except Exception as e:
            self._refuse("invalid", f"{type(e).__name__}: {e}")
            return False

    def _apply(self, ann: dict[str, Any]) -> bool:
        version = int(ann["policy_version"])
        self.last_announced_ms = int(ann["created_at_ms"])
        if version <= self.version:
            return False
        if ann["tokenizer_id"] != self.tokenizer_id:
            self._refuse("tokenizer", f"{ann['tokenizer_id']} != {self.tokenizer_id}")
            return False
        try:
            if not ModelConfig.from_json(ann["model_config"]).same_architecture(self.cfg):
                self._refuse("model_config", ann["model_config"])
                return False
        except InvalidConfigError as e:
            self._refuse("model_config", str(e))
            return False
        if ann["format"] not in FORMATS:
            self._refuse("format", f"{ann['format']!r} is not one of {', '.join(FORMATS)}")
            return False
        try:
            where = self._where(ann["checkpoint_uri"], ann.get("transfer"))
        except Refusal as r:
            self._refuse(r.reason, r.detail)
            if self.refused[r.reason] == 1:
                log.error(
                    "the trainer's weights (version %d at %s) are outside this producer's "
                    "checkpoint roots %s or unreadable here, and %s: it keeps sampling "
                    "version %d until it is started with --checkpoint-root %s (or a folder "
                    "above it)%s",
                    version,
                    ann["checkpoint_uri"],
                    ", ".join(str(r) for r in self.allowed_roots),
                    "the trainer sent no copy to the cluster"
                    if ann.get("transfer") is None
                    else f"this producer's weights source is {self.source}",
                    self.version,
                    _run_dir_of(ann["checkpoint_uri"]),
                    "" if ann.get("transfer") is None else " or with --weights-source auto",
                )
            return False
        with span("weights_restore", "weights", version=version):
            params = self._verified(where, ann, version)
        if params is None:
            return False
        try:  # the policy takes them (an inference server may refuse or be gone)
            self.on_weights(params, version)
        except Exception as e:
            self._refuse("policy", f"version {version}: {type(e).__name__}: {e}")
            return False
        self.version = version
        self.accepted += 1
        self.loaded_from[_source(where)] += 1
        log.info(
            "weights loaded version=%d path=%s from=%s",
            version,
            _cut(str(ann["checkpoint_uri"])),
            _source(where),
        )
        return True

    def _where(self, uri: str, transfer: dict[str, Any] | None) -> Path | dict[str, Any]:
        """Where to read the checkpoint at ``uri``: its folder, when this producer may
        and can read it, or else the trainer's ``transfer`` to the cluster, as
        :attr:`source` allows (:class:`Refusal` when neither)."""
        reason = "this producer's weights source is cluster"
        if self.source != "cluster":
            try:
                path = checkpoint_path(uri, self.allowed_roots)
                if path.is_dir() and os.access(path, os.R_OK | os.X_OK):
                    return path
                reason = f"{path} is not a readable folder here"
            except ValueError as e:
                reason = str(e)
        if self.source == "directory":
            raise Refusal("uri", reason)
        if transfer is None:
            raise Refusal("uri", f"{reason}, and the trainer sent no copy to the cluster")
        return transfer

    def _verified(self, where: Path | dict[str, Any], ann: dict[str, Any], version: int) -> Any:
        """The parameters of announcement ``ann`` read from ``where`` if its files hash
        to the announced digest and say ``version``, and every parameter is finite; else
        None (refused). They are restored from a private copy made while hashing; adapters
        (``orbax-lora``) are merged into their verified base."""
        announced, fmt = ann["digest"], ann["format"]
        try:
            with tempfile.TemporaryDirectory(prefix="rlstream-weights-") as tmp:
                copy = self._copy(where, announced, Path(tmp) / "ckpt", version)
                try:
                    saved = saved_version(copy)
                    meta = adapter_meta(copy)
                except ValueError as e:
                    raise Refusal("version", str(e)) from None
                if saved is not None and saved != version:
                    raise Refusal("version", f"announced version {version}, the files say {saved}")
                if (meta is not None) != (fmt == "orbax-lora"):
                    raise Refusal("format", f"announced as {fmt}, the files say otherwise")
                try:
                    if meta is None:
                        params = restore_params(copy, self.cfg)
                    else:
                        lora, base_uri, base_digest = meta
                        base = self._base_params(base_uri, base_digest, ann.get("base_transfer"))
                        adapters = restore_adapters(copy, self.cfg, lora)
                        params = merged(base, adapters, lora.scale)
                except Refusal:
                    raise
                except Exception as e:  # any orbax failure keeps the old weights
                    raise Refusal("restore", repr(e)) from None
        except Refusal as r:
            self._refuse(r.reason, r.detail)
            return None
        if not all_finite(params):
            self._refuse("non_finite", f"parameters of version {version} hold NaN or infinity")
            return None
        return params

    def _copy(self, where: Path | dict[str, Any], announced: str, into: Path, version: int) -> Path:
        """A private copy of the checkpoint in the folder or the cluster's sending
        ``where`` whose files hash to ``announced`` (:class:`Refusal` otherwise)."""
        try:
            if isinstance(where, Path):
                actual = snapshot(where, self.allowed_roots, into)
            else:
                actual = fetch_checkpoint(self.kafka, self.namespace, where, version, into)
        except Refusal as e:
            raise Refusal(f"transfer_{e.reason}", e.detail) from None
        except ValueError as e:
            raise Refusal("uri", str(e)) from None
        except OSError as e:
            raise Refusal("unreadable", str(e)) from None
        if actual != announced:
            raise Refusal("digest", f"{_cut(str(where))}: announced {announced}, found {actual}")
        return into

    def _base_params(self, uri: str, announced: str, transfer: dict[str, Any] | None) -> Any:
        """The base checkpoint LoRA adapters name, verified like any announced one and
        kept: loaded once however many adapter versions follow. Where it is read from is
        decided first, every time: a cached digest never vouches for a path outside the
        roots."""
        try:
            where = self._where(uri, transfer)
        except Refusal as r:
            raise Refusal(r.reason, f"base: {r.detail}") from None
        if self._base is not None and self._base[0] == announced:
            return self._base[1]
        with tempfile.TemporaryDirectory(prefix="rlstream-base-") as tmp:
            copy = self._copy(where, announced, Path(tmp) / "base", 0)
            params = restore_params(copy, self.cfg)
        if not all_finite(params):
            raise Refusal("non_finite", f"the base {uri} holds NaN or infinity")
        self._base = (announced, params)
        log.info("weights base loaded path=%s from=%s", _cut(uri), _source(where))
        return params


def _source(where: Path | dict[str, Any]) -> str:
    """Where files were read from: the folder (a path) or the cluster (a sending)."""
    return "directory" if isinstance(where, Path) else "cluster"


def _run_dir_of(uri: str) -> str:
    """The run directory above an announced ``.../weights/vN`` (the URI itself if not)."""
    path = Path(urlparse(uri).path or uri)
    for parent in path.parents:
        if parent.name == "weights":
            return str(parent.parent)
    return str(path)


def _cut(text: str, limit: int = 300) -> str:
    """``text`` for one log line: at most ``limit`` characters, its full size noted."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
