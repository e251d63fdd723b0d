"""Tenants and their API keys: who a request comes from, what it may use, which cache it shares.

A deployment runs open (no keys: every request is the ``anonymous`` tenant, as vLLM without
``--api-key``), with one key (``--api-key``: one tenant, ``default``), or with a tenants file
(``[server] tenants = "tenants.toml"``). Keys are stored as SHA-256 digests (``baton keys hash``
prints one), so the file holds no secret; a key is identified in logs and usage records by a short
``key_id`` taken from its digest.

Each tenant's prefix-cache namespace is its own by default, so tenants never share KV blocks; two
tenants that name the same ``cache_namespace`` opt into sharing one.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from pathlib import Path

import tomllib
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

ANONYMOUS = "anonymous"
_DIGEST_PREFIX = "sha256:"


def hash_key(key: str) -> str:
    """The stored form of an API key: ``sha256:<hex>``."""
    return _DIGEST_PREFIX + hashlib.sha256(key.encode()).hexdigest()


def key_id(digest: str) -> str:
    """A short, non-secret name for a key (for logs and usage records)."""
    return "key-" + digest.removeprefix(_DIGEST_PREFIX)[:12]


class TenantSpec(BaseModel):
    """One ``[tenants.NAME]`` table of the tenants file."""

    model_config = ConfigDict(extra="forbid")
    api_keys: list[str] = Field(default_factory=list, description="sha256:<hex> digests (baton keys hash KEY)")
    priority: int = Field(0, description="the tenant's class: lower is served first (vLLM's convention)")
    requests_per_second: float | None = Field(None, gt=0)
    request_burst: float | None = Field(None, ge=1, description="default: one second's worth, at least 1")
    tokens_per_second: float | None = Field(None, gt=0, description="prompt + max_tokens, refunded at finish")
    token_burst: float | None = Field(None, ge=1, description="default: ten seconds' worth")
    max_concurrent_requests: int | None = Field(None, ge=1)
    kv_block_budget: int | None = Field(None, ge=1, description="KV blocks its admitted requests may reserve")
    cache_namespace: str | None = Field(None, min_length=1, description="default: the tenant's own")
    allow_degrade: bool = Field(False, description="cap max_tokens or n to what fits instead of queueing")

    @field_validator("api_keys")
    @classmethod
    def _digests(cls, keys: list[str]) -> list[str]:
        for k in keys:
            hexpart = k.removeprefix(_DIGEST_PREFIX)
            if not k.startswith(_DIGEST_PREFIX) or len(hexpart) != 64 or any(c not in "0123456789abcdef"
                                                                           for c in hexpart):
                raise ValueError("api_keys hold sha256:<64 hex> digests, not keys (baton keys hash KEY)")
        return keys


class TenantsFile(BaseModel):
    """The tenants file: ``[tenants.NAME]`` tables and an optional ``[admin]`` table of keys."""

    model_config = ConfigDict(extra="forbid")
    tenants: dict[str, TenantSpec] = Field(default_factory=dict)
    admin: TenantSpec = Field(default_factory=TenantSpec)


@dataclass(frozen=True)
class Tenant:
    """A tenant as admission sees it."""

    name: str
    priority: int = 0
    requests_per_second: float | None = None
    request_burst: float | None = None
    tokens_per_second: float | None = None
    token_burst: float | None = None
    max_concurrent_requests: int | None = None
    kv_block_budget: int | None = None
    cache_namespace: str = ""
    allow_degrade: bool = False

    def cache_salt(self, client_salt: str | None) -> str | None:
        """The prefix-cache salt for a request: the tenant's namespace, then the client's own salt."""
        if not self.cache_namespace:
            return client_salt
        return self.cache_namespace if not client_salt else f"{self.cache_namespace}\x1f{client_salt}"


@dataclass(frozen=True)
class Identity:
    """Who sent a request: its tenant and the key it used (None without keys)."""

    tenant: Tenant
    key_id: str | None = None


class AuthenticationError(Exception):
    """No key, or a key no tenant holds (HTTP 401)."""


@dataclass
class TenantDirectory:
    """Keys to tenants. Without any key configured every request is the ``anonymous`` tenant."""

    tenants: dict[str, Tenant] = field(default_factory=dict)
    _by_digest: dict[str, str] = field(default_factory=dict)
    _admin: set[str] = field(default_factory=set)

    @property
    def open(self) -> bool:
        """True when no key is configured: requests are not authenticated."""
        return not self._by_digest

    @classmethod
    def anonymous(cls) -> TenantDirectory:
        # An open server keeps the client's cache_salt as the only namespace, as before tenants.
        return cls({ANONYMOUS: Tenant(ANONYMOUS)})

    @classmethod
    def single_key(cls, api_key: str) -> TenantDirectory:
        """``--api-key``: one key, one tenant named ``default``."""
        d = cls({"default": Tenant("default", cache_namespace="default")})
        d._by_digest[hash_key(api_key)] = "default"
        return d

    @classmethod
    def from_file(cls, path: str | Path, api_key: str | None = None) -> TenantDirectory:
        """Read a tenants file (ValueError naming the field when invalid); ``api_key`` adds ``default``."""
        p = Path(path)
        try:
            parsed = TenantsFile.model_validate(tomllib.loads(p.read_text()))
        except FileNotFoundError:
            raise ValueError(f"tenants file {p} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{p}: not valid TOML: {exc}") from None
        except ValidationError as exc:
            first = exc.errors()[0]
            raise ValueError(f"{p}: {'.'.join(str(x) for x in first['loc'])}: {first['msg']}") from None
        d = cls.single_key(api_key) if api_key else cls()
        for name, spec in parsed.tenants.items():
            if name in d.tenants:
                raise ValueError(f"{p}: tenant {name!r} is defined twice (--api-key makes 'default')")
            d.tenants[name] = Tenant(name, spec.priority, spec.requests_per_second, spec.request_burst,
                                     spec.tokens_per_second, spec.token_burst, spec.max_concurrent_requests,
                                     spec.kv_block_budget, spec.cache_namespace or name, spec.allow_degrade)
            for digest in spec.api_keys:
                if digest in d._by_digest:
                    raise ValueError(f"{p}: one key is given to tenants {d._by_digest[digest]!r} and {name!r}")
                d._by_digest[digest] = name
        d._admin.update(parsed.admin.api_keys)
        if not d._by_digest:
            raise ValueError(f"{p}: no tenant has an API key")
        return d

    def authenticate(self, authorization: str | None, x_api_key: str | None = None) -> Identity:
        """The identity behind an ``Authorization: Bearer KEY`` (or ``x-api-key``) header."""
        if self.open:
            return Identity(self.tenants[ANONYMOUS])
        key = _bearer(authorization) or (x_api_key or "").strip()
        if not key:
            raise AuthenticationError("You didn't provide an API key. Send it as 'Authorization: Bearer KEY'.")
        digest = hash_key(key)
        name = self._lookup(digest)
        if name is None:
            raise AuthenticationError("Incorrect API key provided.")
        return Identity(self.tenants[name], key_id(digest))

    def is_admin(self, authorization: str | None) -> bool:
        """Whether the header carries an admin key (or any tenant key when no admin key is set)."""
        key = _bearer(authorization)
        if not key:
            return False
        digest = hash_key(key)
        if self._admin:
            return any(hmac.compare_digest(digest, a) for a in self._admin)
        return self._lookup(digest) is not None

    def _lookup(self, digest: str) -> str | None:
        # Digests of secrets of high entropy: a dict lookup leaks nothing useful by its timing.
        return self._by_digest.get(digest)


def _bearer(authorization: str | None) -> str:
    if not authorization:
        return ""
    scheme, _, value = authorization.strip().partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""
