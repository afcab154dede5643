"""URLs in profiles: what logs may show of them, and the credentials they must not carry."""

from __future__ import annotations

from urllib.parse import urlsplit

from memory.errors import ConfigError


def public_url(url: str) -> str:
    """``url`` as logs and messages may show it: ``scheme://host[:port]/path``.

    Drops a ``user:password@``, a query (``?api_key=...``) and a fragment, so a
    secret put in a URL is never written into a log line or an error a member sees.
    """
    try:
        parts = urlsplit(url)
        port = f":{parts.port}" if parts.port is not None else ""
    except ValueError:  # a malformed port or host: show nothing of it
        return "<malformed URL>"
    if not parts.scheme or not parts.hostname:
        return "<malformed URL>"
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}{port}{parts.path}"


def refuse_url_credentials(key: str, url: str, source: str = "") -> None:
    """Refuse a URL that carries a user, password, query or fragment.

    A key put in a URL would be written into log lines (httpx's own included) and
    into the errors and fallback reasons members see.

    Args:
        key: The setting, for the message (``reranker.url``).
        url: Its value.
        source: The profile file, when there is one.

    Raises:
        ConfigError: ``url`` has any of them; the message shows only its public part.
    """
    where = f"{source}: " if source else ""
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unclosed [ of an IPv6 host
        raise ConfigError(f"{where}{key} is not a valid URL") from None
    if "@" in parts.netloc or parts.query or parts.fragment:
        raise ConfigError(
            f"{where}{key} must not carry credentials or a query (user:password@, "
            f"?api_key=...): give {public_url(url)} and put the key in an environment "
            f"variable named by {key.rsplit('.', 1)[0]}.api_key_env"
        )
