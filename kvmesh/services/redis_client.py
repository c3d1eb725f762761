"""The one place kvmesh opens a Redis client, so that every process reads a Redis URL the same way.

A URL carries everything about the connection, in redis-py's format:
- auth: `redis://:PASSWORD@host:6379/0` (Redis `requirepass`) or `redis://USER:PASSWORD@host:6379/0`
  (an ACL user; kvmesh only touches keys starting with `kvmesh:`, so `~kvmesh:*` is enough);
  a password with reserved characters is percent-encoded;
- TLS: `rediss://host:6379/0`, with the certificate options as query parameters:
  `ssl_ca_certs=/path/ca.pem` (the CA that signed Redis's certificate; default: the system's),
  `ssl_certfile=...&ssl_keyfile=...` (a client certificate, for Redis's `tls-auth-clients yes`);
- a Unix socket: `unix:///path/redis.sock?password=...`.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

SCHEMES = ("redis", "rediss", "unix")
TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname")


def check_redis_url(url: str) -> None:
    """ValueError naming `redis_url` when the URL is not one kvmesh can open."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"redis_url must start with {', '.join(s + '://' for s in SCHEMES)}, got {redacted(url)!r}")
    if parts.scheme != "unix" and not parts.hostname:
        raise ValueError(f"redis_url has no host: {redacted(url)!r}")
    if parts.scheme == "redis" and any(option in parts.query for option in TLS_OPTIONS):
        raise ValueError(f"redis_url has TLS options but the scheme redis:// (TLS is rediss://): {redacted(url)!r}")


def connect(url: str, *, aio: bool = True, decode_responses: bool = True, **options):
    """A redis client for `url` (asyncio unless `aio=False`); it connects on first use. `options`
    go to redis-py (socket_timeout, for one)."""
    check_redis_url(url)
    if aio:
        import redis.asyncio as aioredis

        return aioredis.from_url(url, decode_responses=decode_responses, **options)
    import redis

    return redis.Redis.from_url(url, decode_responses=decode_responses, **options)


def redacted(url: str) -> str:
    """The URL with its password replaced by `***`, for logs and summaries."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    netloc = f"{user}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
