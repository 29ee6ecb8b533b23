"""The server's API key, from a flag, a file or the environment (`MINISGL_API_KEY`, the HTTP
server's only environment switch). The key itself never enters an error message."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from minisgl.config.env import API_KEY

ENV_API_KEY = API_KEY.name


def resolve_api_key(
    key: str | None, key_file: str | None, environ: Mapping[str, str] | None = None
) -> str | None:
    """The key from `--api-key`, else `--api-key-file` (its contents without surrounding
    whitespace), else `MINISGL_API_KEY`; None: no authentication. Raises ValueError naming the
    flag or variable to change."""
    if key is not None and key_file is not None:
        raise ValueError("api_key: give --api-key or --api-key-file, not both")
    if key is not None:
        return _non_empty(key, "--api-key")
    if key_file is not None:
        return _non_empty(_read_key_file(key_file), f"--api-key-file {key_file}")
    value = API_KEY.get(environ)
    return None if value is None else _non_empty(value.strip(), ENV_API_KEY)


def _read_key_file(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        raise ValueError(f"api_key_file: cannot read {path}: {reason}") from None


def _non_empty(key: str, source: str) -> str:
    if not key:
        raise ValueError(
            f"api_key: {source} gives an empty key (leave it out to disable authentication)"
        )
    if any(c.isspace() or not c.isprintable() for c in key):
        # It travels in an HTTP header: `Authorization: Bearer <key>`.
        raise ValueError(f"api_key: {source} gives a key with whitespace or control characters")
    return key
