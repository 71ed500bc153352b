"""A Schema Registry client and the Confluent wire format of its records.

Tools built around Kafka (kcat ``-s avro -r URL``, Flink's ``avro-confluent``, Kafka
Connect's Avro converter, ksqlDB) read values framed as::

    00 | schema id (4 bytes, big-endian) | Avro binary body

and look the id up in a registry speaking Confluent's REST API (Confluent Schema Registry,
or Apicurio Registry under ``/apis/ccompat/v7``). :class:`SchemaRegistry` registers
rlstream's schemas under ``<topic>-value`` subjects with BACKWARD compatibility and
resolves ids back to schemas, caching both ways (ids are immutable).

Only the standard library speaks HTTP here: a registry is a boundary like any other, so
every answer is checked and every failure is one :class:`RegistryError` sentence.
"""

from __future__ import annotations

import base64
import http.client
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

import tenacity

from pipeline.errors import RlstreamError

MAGIC = b"\x00"
HEADER_SIZE = 5
#: The compatibility rlstream gives its subjects: a new reader reads every older record.
COMPATIBILITY = "BACKWARD"
_CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"
#: Unknown ids remembered (so a flood of corrupt records does not become a flood of
#: requests); beyond this many the oldest are forgotten.
_MAX_MISSES = 1024
#: After a registry did not answer, lookups fail at once for this long (seconds): records
#: are refused quickly instead of each waiting for the retries.
DOWN_S = 5.0


class RegistryError(RlstreamError):
    """The schema registry refused a request or did not answer."""


class UnusableSchemaIdError(RegistryError):
    """The registry answered for a schema id, ``BAD_ANSWERS`` times in a row, with
    something that is not a schema (an error status, a body that is not JSON or too
    large): records framed with that id can never be read, unlike while it is down."""


#: answers for one schema id that are not a schema, in a row, before the id is given up
BAD_ANSWERS = 5


def framing(schema_id: int) -> bytes:
    """The 5-byte Confluent header of records written with schema ``schema_id``."""
    if not 0 <= schema_id < 2**31:
        raise RegistryError(f"schema id {schema_id} does not fit the Confluent wire format")
    return MAGIC + schema_id.to_bytes(4, "big")


def schema_id_of(data: bytes) -> int:
    """The schema id of a Confluent-framed value (the caller checked its length)."""
    return int.from_bytes(data[1:HEADER_SIZE], "big")


@dataclass(frozen=True)
class RegistryConfig:
    """Where the registry is and how to authenticate (HTTP basic auth, optional)."""

    url: str
    username: str | None = None
    password: str | None = None
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        parsed = urllib.parse.urlsplit(self.url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise RegistryError(
                f"schema registry URL {self.url!r} is not http(s)://host[:port][/path]"
            )
        if (self.username is None) != (self.password is None):
            raise RegistryError("schema registry basic auth needs both a user and a password")


class SchemaRegistry:
    """Registers and resolves Avro schemas (as JSON text) through Confluent's REST API."""

    def __init__(self, config: RegistryConfig) -> None:
        self.config = config
        self._base = config.url.rstrip("/")
        self._lock = threading.Lock()
        self._ids: dict[tuple[str, str], int] = {}
        self._texts: dict[int, str] = {}
        self._missing: dict[int, str] = {}
        #: schema id -> unusable answers in a row, and the last one's reason
        self._bad: dict[int, tuple[int, str]] = {}
        self._down_until = 0.0
        self._down_reason = ""
        self.requests = 0

    def __repr__(self) -> str:
        return f"SchemaRegistry({self._base!r})"

    # ---- writing -------------------------------------------------------------------

    def register(self, subject: str, schema_text: str) -> int:
        """The id of ``schema_text`` under ``subject``, registering it (and giving a new
        subject BACKWARD compatibility) when the registry does not have it yet. A schema
        the subject's compatibility refuses raises with the registry's reason."""
        key = (subject, schema_text)
        with self._lock:
            if key in self._ids:
                return self._ids[key]
        path = f"/subjects/{urllib.parse.quote(subject, safe='')}"
        if self._request("GET", "/subjects", what="list subjects").count(subject) == 0:
            self._request(
                "PUT",
                f"/config/{urllib.parse.quote(subject, safe='')}",
                {"compatibility": COMPATIBILITY},
                what=f"set {COMPATIBILITY} compatibility on subject {subject}",
            )
        answer = self._request(
            "POST",
            f"{path}/versions",
            {"schema": schema_text},
            what=f"register the schema under subject {subject}",
        )
        schema_id = answer.get("id") if isinstance(answer, dict) else None
        if not isinstance(schema_id, int) or isinstance(schema_id, bool):
            raise RegistryError(f"the schema registry answered {str(answer)[:200]!r} without an id")
        framing(schema_id)  # in range
        with self._lock:
            self._ids[key] = schema_id
            self._texts.setdefault(schema_id, schema_text)
        return schema_id

    # ---- reading -------------------------------------------------------------------

    def schema_text(self, schema_id: int) -> str | None:
        """The schema registered as ``schema_id``, or None when the registry has no such
        id (remembered). Unreachable registries raise :class:`RegistryError`."""
        with self._lock:
            if schema_id in self._texts:
                return self._texts[schema_id]
            if schema_id in self._missing:
                return None
            bad, why = self._bad.get(schema_id, (0, ""))
            if bad >= BAD_ANSWERS:
                raise UnusableSchemaIdError(why)
            if time.monotonic() < self._down_until:  # it failed a moment ago: fail fast
                raise RegistryError(self._down_reason)
        try:
            answer = self._request("GET", f"/schemas/ids/{schema_id}", what=f"look up {schema_id}")
            text = answer.get("schema") if isinstance(answer, dict) else None
            if not isinstance(text, str):
                raise RegistryError(
                    f"schema id {schema_id}: the registry answered without a schema"
                )
        except _Down as e:
            with self._lock:
                self._down_until = time.monotonic() + DOWN_S
                self._down_reason = f"{e} (not asked again for {DOWN_S:.0f} s)"
            raise RegistryError(str(e)) from None
        except _NotFound:
            with self._lock:
                if len(self._missing) >= _MAX_MISSES:
                    self._missing.pop(next(iter(self._missing)))
                self._missing[schema_id] = ""
            return None
        except _Unauthorized:  # the same for every id: held until the credentials work
            raise
        except RegistryError as e:  # it answered, with no schema: counted against the id
            with self._lock:
                bad = self._bad.get(schema_id, (0, ""))[0] + 1
                if len(self._bad) >= _MAX_MISSES and schema_id not in self._bad:
                    self._bad.pop(next(iter(self._bad)))
                why = f"{e} ({bad} answers in a row)"
                self._bad[schema_id] = (bad, why)
            if bad >= BAD_ANSWERS:
                raise UnusableSchemaIdError(why) from None
            raise
        with self._lock:
            self._texts[schema_id] = text
            self._bad.pop(schema_id, None)
        return text

    # ---- HTTP ----------------------------------------------------------------------

    def _request(self, method: str, path: str, body: Any = None, *, what: str) -> Any:
        """One request, tried again (three tries in about 1.5 s) when the connection fails
        or drops: every request rlstream makes is idempotent (registering a schema the
        subject holds answers its id). What the registry answers is never retried."""
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(_Unreachable),
            stop=tenacity.stop_after_attempt(3),
            wait=tenacity.wait_exponential(multiplier=0.5, max=2.0),
            reraise=True,
        )
        try:
            return retrying(self._request_once, method, path, body, what=what)
        except _Unreachable as e:
            raise _Down(str(e)) from None

    def _request_once(self, method: str, path: str, body: Any, *, what: str) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self._base + path, data=data, method=method)
        req.add_header("Accept", f"{_CONTENT_TYPE}, application/json")
        if data is not None:
            req.add_header("Content-Type", _CONTENT_TYPE)
        if self.config.username is not None:
            token = f"{self.config.username}:{self.config.password}".encode()
            req.add_header("Authorization", "Basic " + base64.b64encode(token).decode())
        self.requests += 1
        try:
            with urllib.request.urlopen(req, timeout=self.config.timeout_s) as resp:
                raw = resp.read(4 * 2**20)
        except urllib.error.HTTPError as e:
            reason = _reason(e)
            if e.code == 404 and method == "GET":
                raise _NotFound(reason) from None
            if e.code in (401, 403):
                raise _Unauthorized(
                    f"the schema registry at {self._base} refused the credentials "
                    f"(HTTP {e.code}) trying to {what}: {reason}"
                ) from None
            raise RegistryError(
                f"the schema registry at {self._base} refused to {what} (HTTP {e.code}): {reason}"
            ) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            why = getattr(e, "reason", e)
            raise _Unreachable(
                f"the schema registry at {self._base} did not answer ({why}) trying to {what}"
            ) from None
        try:
            return json.loads(raw)
        except ValueError:
            raise RegistryError(
                f"the schema registry at {self._base} answered {raw[:100]!r}, not JSON, "
                f"trying to {what}"
            ) from None


class _NotFound(RegistryError):
    pass


class _Unauthorized(RegistryError):
    pass


class _Down(RegistryError):
    """The registry did not answer after the retries."""


class _Unreachable(Exception):
    """The connection failed or dropped (tried again before it becomes an error)."""


def _reason(e: urllib.error.HTTPError) -> str:
    """The registry's own words from an error answer (``{"message": ...}``)."""
    try:
        body = e.read(64 * 1024)
        message = json.loads(body).get("message")
    except Exception:  # not JSON, or no body
        message = None
    text = str(message) if message else str(e.reason)
    return " ".join(text.split())[:300]
