"""Helpers of the secrets tests: every spelling of a password that must not be stored, and every cell Dagster's
SQLite storage holds, decoded (Dagster 1.13 keeps run config and job snapshots zlib-compressed: a byte search of the
files cannot see into them)."""

from __future__ import annotations

import base64
import contextlib
import sqlite3
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from urllib.parse import quote


def password_forms(user: str, password: str) -> list[str]:
    """A password as typed, percent-encoded, each fragment between its ``,`` and ``@`` (an error quoting a URL cut
    at one of them holds a fragment), and the ``Authorization: Basic`` value it becomes."""
    fragments = password.replace("@", ",").split(",")
    basic = base64.b64encode(f"{user}:{password}".encode()).decode()
    return [password, quote(password, safe=""), *fragments, basic]


def with_password(base_url: str, user: str, password: str) -> str:
    """``http://host/v1`` -> ``http://user:password@host/v1`` (the password as given: raw or already encoded)."""
    return base_url.replace("://", f"://{user}:{password}@", 1)


def leaks(where: str, text: str, needles: Iterable[str]) -> list[str]:
    """One line per needle found in ``text``, with what precedes it (to tell where it came from)."""
    found = []
    for needle in needles:
        at = text.find(needle)
        if at >= 0:
            found.append(f"{where}: {needle!r} after ...{text[max(0, at - 80) : at]!r}")
    return found


def sqlite_texts(home: Path) -> Iterator[tuple[str, str]]:
    """(``file:table``, text) for every cell of every table of every SQLite file under ``home``, blobs decompressed."""
    for db in sorted(home.rglob("*.db")):
        with contextlib.closing(sqlite3.connect(db)) as connection:
            tables = [name for (name,) in connection.execute("SELECT name FROM sqlite_master WHERE type='table'")]
            for table in tables:
                for row in connection.execute(f'SELECT * FROM "{table}"'):
                    for cell in row:
                        if isinstance(cell, bytes):
                            with contextlib.suppress(zlib.error):  # else stored as is
                                cell = zlib.decompress(cell)
                            cell = cell.decode("utf-8", errors="replace")
                        yield f"{db.name}:{table}", str(cell)
