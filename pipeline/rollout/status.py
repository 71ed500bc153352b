"""A producer's status file: one JSON line per second, read by ``rlstream run``'s live
display and report."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from connectors import stats as connector_stats


def status_line(producer: Any) -> dict[str, Any]:
    """What a producer reports about itself now."""
    st = producer.stats
    done = sum(st.finished.values())
    return {
        "time": time.time(),
        "producer_id": producer.cfg.producer_id,
        "episodes": done,
        "in_flight": st.started - done - st.dropped,
        "paused": st.paused,
        "paused_s": round(producer.paused_seconds(), 3),
        "paused_by": producer.paused_by(),
        "in_flight_age_s": producer.in_flight_ages(),
        "running_s": round(producer.running_seconds(), 3),
        "waiting": st.waiting,
        "lag": st.lag,
        "version": producer.version,
        "sent": producer.writer.sent,
        "delivered": producer.writer.delivered,
        "failed": producer.writer.failed,
        "budget_share": st.share,
        "peers": st.peers,
        "peers_in_flight": st.peers_in_flight,
        "behind": st.behind,
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


class StatusFile:
    """Appends :func:`status_line` to ``path`` (created with its folder)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, producer: Any) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(status_line(producer)) + "\n")
