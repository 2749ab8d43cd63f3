"""The API key file and the look-up of a presented key.

The file (`--api-keys FILE`) is a JSON or YAML list; each entry names one key and its tenant:

    - key: sk-team-a-1            # or key_sha256: <hex SHA-256 of the key>
      tenant: team-a
      requests_per_minute: 600    # each limit optional; absent = unlimited
      tokens_per_minute: 200000   # prompt tokens + max output tokens, per minute
      concurrent_requests: 32
      slo_ttft_ms: 2000           # the tenant's objective (admission control); optional
      slo_tpot_ms: 150
      weight: 2                   # its fair share of a saturated pool against others; 1

Several keys may share a tenant; a tenant's limits (and its SLO and weight) are the first of its
entries that sets them (entries of one tenant must not disagree). Only SHA-256 digests are kept
in memory. A presented key is hashed and its digest compared with every stored one by
`hmac.compare_digest`, without stopping at a match: the time taken depends on the number of
keys, never on how much of a real key the client guessed (about 0.1 us per key).

`api_key_from_headers` is the one reading of a request's key, for every API (OpenAI's
`Authorization: Bearer`, Anthropic's `x-api-key`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from splitserve.gateway.admission.slo import Slo, slo_milliseconds

# No "/": the tenant's cache salt ends at its name (splitserve.engine.kv.block_hash).
TENANT_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's limits; None = unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None  # prompt tokens + max output tokens
    concurrent_requests: int | None = None

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{item.name} must be a positive integer, got {value!r}")

    @property
    def is_unlimited(self) -> bool:
        return all(getattr(self, item.name) is None for item in fields(self))


LIMIT_NAMES = tuple(item.name for item in fields(TenantLimits))


@dataclass(frozen=True)
class TenantService:
    """What admission control promises a tenant: its SLO (over the gateway's default) and
    its weight in the fair share of a saturated pool."""

    slo: Slo = Slo()
    weight: float = 1.0

    @property
    def is_default(self) -> bool:
        return self == TenantService()


SERVICE_NAMES = ("slo_ttft_ms", "slo_tpot_ms", "weight")


@dataclass(frozen=True)
class ApiKey:
    tenant: str
    limits: TenantLimits
    service: TenantService = TenantService()

    @property
    def slo(self) -> Slo:
        return self.service.slo


class KeyRing:
    """The keys of one key file: digest -> ApiKey."""

    def __init__(self, keys: Mapping[bytes, ApiKey]) -> None:
        self._keys = dict(keys)
        self.tenants = frozenset(key.tenant for key in self._keys.values())
        self._weights = {key.tenant: key.service.weight for key in self._keys.values()}

    def __len__(self) -> int:
        return len(self._keys)

    def lookup(self, presented: str) -> ApiKey | None:
        digest = hashlib.sha256(presented.encode("utf-8", "surrogatepass")).digest()
        found = None
        for stored, key in self._keys.items():  # every digest, no early exit
            if hmac.compare_digest(stored, digest):
                found = key
        return found

    @classmethod
    def from_file(cls, path: str | Path) -> KeyRing:
        """Raises ValueError naming the file and the entry at fault."""
        try:
            text = Path(path).read_text()
        except OSError as error:
            raise ValueError(f"--api-keys: {error}") from None
        try:
            entries = json.loads(text) if text.lstrip().startswith("[") else yaml.safe_load(text)
        except (ValueError, yaml.YAMLError) as error:
            raise ValueError(f"--api-keys: {path} is not JSON or YAML: {error}") from None
        return cls.from_entries(entries, str(path))

    @classmethod
    def from_entries(cls, entries: object, source: str = "keys") -> KeyRing:
        if not isinstance(entries, list) or not entries:
            raise ValueError(f"--api-keys: {source} must be a non-empty list of keys")
        keys: dict[bytes, ApiKey] = {}
        limits_of: dict[str, TenantLimits] = {}
        service_of: dict[str, TenantService] = {}
        for index, entry in enumerate(entries):
            try:
                digest, key = _entry(entry)
            except ValueError as error:
                raise ValueError(f"--api-keys: {source} entry {index}: {error}") from None
            if digest in keys:
                raise ValueError(f"--api-keys: {source} entry {index}: a key given twice")
            known = limits_of.setdefault(key.tenant, key.limits)
            known_service = service_of.setdefault(key.tenant, key.service)
            if (key.limits != known and not key.limits.is_unlimited) or (
                key.service != known_service and not key.service.is_default
            ):
                raise ValueError(
                    f"--api-keys: {source} entry {index}: tenant {key.tenant!r} has other "
                    "limits, SLO or weight in an earlier entry"
                )
            keys[digest] = key
        # A tenant's keys share its limits and service (one entry may set them for all).
        return cls(
            {
                d: ApiKey(k.tenant, limits_of[k.tenant], service_of[k.tenant])
                for d, k in keys.items()
            }
        )

    def weight_of(self, tenant: str) -> float:
        """The tenant's fair-share weight (1 for a tenant of no key: anonymous traffic)."""
        return self._weights.get(tenant, 1.0)


def _entry(entry: object) -> tuple[bytes, ApiKey]:
    if not isinstance(entry, dict):
        raise ValueError("must be a mapping with key (or key_sha256) and tenant")
    unknown = set(entry) - {"key", "key_sha256", "tenant", *LIMIT_NAMES, *SERVICE_NAMES}
    if unknown:
        raise ValueError(f"unknown field(s) {sorted(unknown)}")
    if ("key" in entry) == ("key_sha256" in entry):
        raise ValueError("give exactly one of key and key_sha256")
    tenant = entry.get("tenant")
    if not isinstance(tenant, str) or not TENANT_PATTERN.fullmatch(tenant):
        raise ValueError("tenant must be 1-64 letters, digits, '_', '.', ':' or '-'")
    if "key" in entry:
        if not isinstance(entry["key"], str) or len(entry["key"]) < 8:
            raise ValueError("key must be a string of at least 8 characters")
        digest = hashlib.sha256(entry["key"].encode("utf-8")).digest()
    else:
        hex_digest = entry["key_sha256"]
        if not isinstance(hex_digest, str) or not _SHA256_HEX.fullmatch(hex_digest.lower()):
            raise ValueError("key_sha256 must be 64 hex digits")
        digest = bytes.fromhex(hex_digest)
    limits = TenantLimits(**{name: entry[name] for name in LIMIT_NAMES if name in entry})
    return digest, ApiKey(tenant, limits, _service(entry))


def _service(entry: dict) -> TenantService:
    ttft, tpot = (entry.get(name) for name in SERVICE_NAMES[:2])
    slo = Slo(
        None if ttft is None else slo_milliseconds("slo_ttft_ms", ttft),
        None if tpot is None else slo_milliseconds("slo_tpot_ms", tpot),
    )
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight <= 1e6:
        raise ValueError(f"weight must be a positive number, got {weight!r}")
    return TenantService(slo, float(weight))


def api_key_from_headers(headers: Mapping[str, str]) -> str | None:
    """The key a request presents: `Authorization: Bearer KEY` (OpenAI's clients), else
    `x-api-key: KEY` (Anthropic's). `headers` keyed by lower-case names."""
    authorization = headers.get("authorization", "")
    scheme, _, credentials = authorization.partition(" ")
    if scheme.lower() == "bearer" and credentials.strip():
        return credentials.strip()
    key = headers.get("x-api-key", "").strip()
    return key or None
