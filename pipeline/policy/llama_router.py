"""Weights to llama.cpp's server in router mode (``llama-server --models-dir DIR``): each
version a producer loads is written as ``DIR/<prefix>-v<N>.gguf`` (float32,
:mod:`pipeline.policy.gguf_file`) and loaded with ``POST /models/load``; the model's name
carries its version, so the name a server answers with says which version sampled."""

from __future__ import annotations

import json
import logging
import re
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from pipeline.errors import InvalidConfigError, RlstreamError
from pipeline.observe.telemetry import span
from pipeline.policy import gguf_file
from pipeline.policy.config import ModelConfig

log = logging.getLogger(__name__)

#: GGUF files of older versions kept in the models folder (a server may still be
#: finishing turns with them)
KEEP_VERSIONS = 3


class RemotePolicyError(RlstreamError):
    """The policy server could not be reached, dropped a turn, answered with something
    that cannot be recorded or could not load a version; the message says which."""


class LlamaRouter:
    """Publishes versions of ``model`` to the llama.cpp router at ``url`` through its
    models folder."""

    def __init__(
        self, url: str, models_dir: Path, model: ModelConfig, prefix: str, load_timeout_s: float
    ) -> None:
        try:
            import gguf  # noqa: F401
        except ImportError:
            raise InvalidConfigError(
                "writing versions for llama.cpp's server needs the gguf package: "
                "pip install 'rlstream[inference-server]'"
            ) from None
        self.url = url
        self.models_dir = models_dir
        self.model = model
        self.prefix = prefix
        self.load_timeout_s = load_timeout_s

    def publish(self, params: Any, version: int) -> tuple[str, int | None]:
        """Write ``params`` as ``version``, have the router load it; the model's name and
        the tokens one sequence may hold at the server (None: it does not say)."""
        from pipeline.policy.hf_weights import hf_files

        name = f"{self.prefix}-v{version}"
        with span("weights_export", "weights", version=version):
            config, tokenizer, tensors = hf_files(self.model, params)
            gguf_file.write(self.models_dir / f"{name}.gguf", config, tokenizer, tensors)
        with span("weights_server_load", "weights", version=version):
            self._load(name)
        context = self._context_size(name)
        self._prune(version)
        return name, context

    def _load(self, name: str) -> None:
        """Make the router see the folder again, load ``name`` and wait until it has."""
        deadline = time.monotonic() + self.load_timeout_s
        http("GET", f"{self.url}/models?reload=1", None, 30)
        status, text = http("POST", f"{self.url}/models/load", {"model": name}, 30)
        if status == 404:
            raise RemotePolicyError(
                f"the server at {self.url} loads no models (start llama.cpp's server as a "
                f"router: llama-server --models-dir {self.models_dir})"
            )
        if status != 200 and "already" not in text:
            raise RemotePolicyError(f"server error: loading {name}: {status} {cut(text)}")
        while True:
            status, text = http("GET", f"{self.url}/models", None, 30)
            state = model_state(text, name) if status == 200 else None
            if state == "loaded":
                return
            if state == "failed":
                raise RemotePolicyError(f"server error: {name} failed to load: {cut(text)}")
            if time.monotonic() > deadline:
                raise RemotePolicyError(
                    f"timeout: {name} not loaded within {self.load_timeout_s:g}s ({state})"
                )
            time.sleep(0.1)

    def _context_size(self, name: str) -> int | None:
        """Tokens one sequence of ``name`` may hold at the server (llama.cpp's
        ``/props``: its context over its parallel slots), None when it does not say."""
        status, text = http("GET", f"{self.url}/props?model={name}", None, 30)
        try:
            n = json.loads(text)["default_generation_settings"]["n_ctx"] if status == 200 else None
        except (ValueError, KeyError, TypeError):
            return None
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            if n < self.model.max_len:
                log.warning(
                    "policy server %s holds %d tokens per sequence, fewer than the model's "
                    "%d: conversations end there (truncated)",
                    self.url,
                    n,
                    self.model.max_len,
                )
            return n
        return None

    def _prune(self, version: int) -> None:
        """Remove this producer's GGUF files of all but the newest versions."""
        assert self.models_dir is not None
        mine = []
        for f in self.models_dir.glob(f"{self.prefix}-v*.gguf"):
            v = version_of(f.stem)
            if v is not None and f.stem == f"{self.prefix}-v{v}":
                mine.append((v, f))
        for v, f in sorted(mine)[:-KEEP_VERSIONS]:
            if v < version:
                f.unlink(missing_ok=True)


def version_of(name: str) -> int | None:
    """The version in a model's name (``<prefix>-v<N>``)."""
    m = re.search(r"-v(\d+)$", name)
    return int(m.group(1)) if m else None


def model_state(text: str, name: str) -> str | None:
    try:
        models = json.loads(text).get("data", [])
    except (ValueError, AttributeError):
        return None
    for m in models:
        if isinstance(m, dict) and name in (m.get("id"), m.get("name")):
            status = m.get("status") or {}
            if status.get("failed"):
                return "failed"
            return str(status.get("value"))
    return None


def http(method: str, url: str, body: Any, timeout: float) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as e:
        raise RemotePolicyError(f"unreachable: {url}: {e}") from None


def cut(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
