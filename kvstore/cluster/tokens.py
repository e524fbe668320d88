"""The one reader of secret files: bearer tokens (the daemon's token table, a client's store
token), the router's API keys.

Secrets live in files, never in argv (visible in `ps`) or etcd. Two layouts, one reader:
- a table, `<secret> <field>` per line (`token_lines`): `#` starts a comment anywhere on a
  line, blank lines are skipped, fields are split on whitespace;
- a single secret (`first_token`): the first line that is neither blank nor a comment, taken
  whole (a token may hold `#`).
A file that cannot be read is a `ConfigError` naming it, never the secret.
"""

from __future__ import annotations

from pathlib import Path

from kvstore.errors import ConfigError

__all__ = ["read_secret_file", "token_lines", "first_token"]


def read_secret_file(path: str | Path, what: str) -> str:
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc}") from exc


def token_lines(path: str | Path, what: str) -> list[tuple[int, list[str]]]:
    """(line number, fields) of every line that holds something, comments removed."""
    out = []
    for lineno, raw in enumerate(read_secret_file(path, what).splitlines(), 1):
        fields = raw.split("#", 1)[0].split()
        if fields:
            out.append((lineno, fields))
    return out


def first_token(path: str | Path, what: str) -> str:
    """The first line of `path` that is neither blank nor a comment."""
    lines = (line.strip() for line in read_secret_file(path, what).splitlines())
    token = next((line for line in lines if line and not line.startswith("#")), None)
    if token is None:
        raise ConfigError(f"the {what} {str(path)!r} holds no token")
    return token
