"""A producer's status file: one JSON line per second, read by ``rlstream run``'s live
display and report."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from connectors import stats as connector_stats
from pipeline.observe.prometheus import Sample


def status_line(producer: Any) -> dict[str, Any]:
    """What a producer reports about itself now."""
    st, gate = producer.stats, producer.gate
    done = sum(st.finished.values())
    return {
        "time": time.time(),
        "producer_id": producer.cfg.producer_id,
        "episodes": done,
        "in_flight": producer.in_flight,
        "paused": gate.paused,
        "paused_s": round(producer.paused_seconds(), 3),
        "paused_by": producer.paused_by(),
        "in_flight_age_s": producer.in_flight_ages(),
        "running_s": round(producer.running_seconds(), 3),
        "waiting": gate.waiting,
        "lag": gate.lag,
        "version": producer.version,
        "sent": producer.writer.sent,
        "delivered": producer.writer.delivered,
        "failed": producer.writer.failed,
        "aborted_stale": st.aborted_stale,
        "budget_share": gate.share,
        "peers": len(gate.peers),
        "peers_in_flight": sum(gate.peers.values()),
        "behind": gate.behind,
        "shared_prompt_tokens": producer.server.shared_prompt_tokens,
        "exactness_checked": producer.exactness.checked,
        "rewritten_turns": producer.exactness.rewritten_turns,
        "divergent_context": producer.exactness.divergent_context,
        "connectors": connector_stats.snapshot(),
        **_server(producer.server),
    }


def _server(policy: Any) -> dict[str, Any]:
    """An inference server's figures (``--policy openai:URL``): turns it answered, turns
    cut before a token it gave no log-probability for, turns that failed by reason."""
    if not hasattr(policy, "cut_turns"):
        return {}
    return {
        "server_turns": policy.turns,
        "server_cut_turns": policy.cut_turns,
        "server_failures": dict(policy.failures),
    }


def prometheus_samples(producer: Any) -> list[Sample]:
    """A producer's figures for Prometheus (read at scrape time)."""
    st, w = producer.stats, producer.writer
    finished = dict(st.finished)
    done = sum(finished.values())
    out = [
        Sample(
            "rlstream_producer_episodes_total",
            n,
            "counter",
            "episodes finished, by status (ok, truncated, timeout, env_error)",
            {"status": status},
        )
        for status, n in sorted(finished.items())
    ]
    out += [
        Sample(
            "rlstream_producer_episodes_in_flight",
            producer.in_flight,
            help="episodes running now",
        ),
        Sample(
            "rlstream_producer_trajectories_per_second",
            done / max(1e-9, producer.running_seconds()),
            help="episodes finished per second since start",
        ),
        Sample("rlstream_producer_records_sent_total", w.sent, "counter", "records produced"),
        Sample(
            "rlstream_producer_records_delivered_total",
            w.delivered,
            "counter",
            "records acknowledged by Kafka",
        ),
        Sample(
            "rlstream_producer_delivery_failures_total",
            w.failed,
            "counter",
            "records Kafka did not acknowledge",
        ),
        Sample(
            "rlstream_producer_episodes_aborted_stale_total",
            st.aborted_stale,
            "counter",
            "episodes ended early, certain to arrive too stale (admission.abort_stale)",
        ),
        Sample(
            "rlstream_producer_policy_version", producer.version, help="policy version sampling now"
        ),
        Sample(
            "rlstream_producer_lag_records",
            producer.gate.lag,
            help="records not yet read by the trainer group (admission control's view)",
        ),
        Sample(
            "rlstream_producer_paused",
            int(producer.gate.paused),
            help="1 while admission holds back",
        ),
        Sample(
            "rlstream_producer_shared_prompt_tokens_total",
            producer.server.shared_prompt_tokens,
            "counter",
            "prompt tokens copied from another conversation's cache instead of prefilled",
        ),
        Sample(
            "rlstream_producer_paused_seconds_total",
            producer.paused_seconds(),
            "counter",
            "seconds held back by admission control",
        ),
    ]
    if producer.weights is not None:
        out += [
            Sample(
                "rlstream_producer_weights_refused_total",
                n,
                "counter",
                "weight announcements refused, by reason",
                {"reason": reason},
            )
            for reason, n in sorted(dict(producer.weights.refused).items())
        ]
        out.append(
            Sample(
                "rlstream_producer_weights_loaded_total",
                producer.weights.accepted,
                "counter",
                "weight announcements loaded",
            )
        )
    for key, n in sorted(connector_stats.snapshot().items()):
        connector, _, event = key.partition("/")
        out.append(
            Sample(
                "rlstream_connector_events_total",
                n,
                "counter",
                "connector events (retries, timeouts, restarts, tool calls ...)",
                {"connector": connector, "event": event},
            )
        )
    return out


class StatusFile:
    """Appends :func:`status_line` to ``path`` (created with its folder)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, producer: Any) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(status_line(producer)) + "\n")
