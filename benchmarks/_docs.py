"""Generated figures into the docs: a page's text between two markers, replaced."""

from __future__ import annotations

from pathlib import Path


def replace_between(page: Path, markers: tuple[str, str], text: str) -> None:
    """Put ``text`` between the page's ``markers`` (start, end), in place of what was there."""
    body = page.read_text()
    start, end = (body.index(m) for m in markers)
    page.write_text(body[: start + len(markers[0])] + "\n" + text + "\n" + body[end:])
