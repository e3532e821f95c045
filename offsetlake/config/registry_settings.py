"""Schema Registry client options (confluent-kafka's ``SchemaRegistryClient``): which keys
offsetlake passes on, what is wrong with a mapping of them, and how they may be shown."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator

# Schema Registry client options offsetlake passes on (confluent-kafka's SchemaRegistryClient);
# numbers are given to it as numbers.
REGISTRY_OPTIONS = {
    "url",
    "basic.auth.user.info",
    "basic.auth.credentials.source",
    "bearer.auth.credentials.source",
    "bearer.auth.token",
    "bearer.auth.logical.cluster",
    "bearer.auth.identity.pool.id",
    "ssl.ca.location",
    "ssl.certificate.location",
    "ssl.key.location",
    "ssl.key.password",
    "proxy",
    "timeout",
    "max.retries",
    "retries.wait.ms",
    "retries.max.wait.ms",
    "cache.latest.ttl.sec",
}
_REGISTRY_SECRET = re.compile(r"(user\.info|password|token|secret)", re.I)


def registry_settings_problem(value: dict[str, str]) -> str | None:
    """What is wrong with a ``schema_registry`` mapping, or None."""
    unknown = sorted(set(value) - REGISTRY_OPTIONS)
    if unknown:
        return f"unknown option {', '.join(unknown)} (known: {', '.join(sorted(REGISTRY_OPTIONS))})"
    url = value.get("url", "")
    if url and not all(u.strip().startswith(("http://", "https://")) for u in url.split(",")):
        return f"url '{url}' must start with http:// or https://"
    user_info = value.get("basic.auth.user.info")
    if user_info is not None and ":" not in user_info:
        return "basic.auth.user.info must be user:password"
    return None


def redacted_registry_settings(value: dict[str, str]) -> dict[str, str]:
    """The registry settings as logs and messages may show them."""
    return {k: ("***" if _REGISTRY_SECRET.search(k) else v) for k, v in value.items()}


def registry_options(value: Any) -> dict[str, str]:
    """A ``schema_registry`` mapping as the client takes it (empty values mean not set)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError("expected a mapping of client options (url: ..., basic.auth.user.info: ...)")
    value = {str(k): str(v) for k, v in value.items() if str(v) != ""}
    problem = registry_settings_problem(value)
    if problem:
        raise ValueError(problem)
    return value


# a ``schema_registry`` field: the client options, checked as ``registry_options`` checks them
RegistryOptions = Annotated[dict[str, str], BeforeValidator(registry_options)]
