"""What an id, a name or a path from a request may be: what the database and the filesystem can take (they
fail on more, rather than answer)."""

from __future__ import annotations

import re

NAME_MAX, PATH_MAX = 255, 4096  # bytes in a file name and in a path (Linux's limits)
CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f]")


def name_problem(value: str) -> str | None:
    """Why `value` cannot be an id, a name or a file path here, or None: none holds a control character (a
    NUL fails PostgreSQL and every file call) or is longer than a path, or a file name, may be."""
    if found := CONTROL_CHARACTER.search(value):
        return f"holds a control character (U+{ord(found.group()):04X}), which no id, name or file path here does"
    if (size := len(value.encode())) > PATH_MAX:
        return f"is {size} bytes long; a path is at most {PATH_MAX} bytes"
    if too_long := [size for part in value.split("/") if (size := len(part.encode())) > NAME_MAX]:
        return f"has a part of {max(too_long)} bytes; an id, a name or a file name is at most {NAME_MAX}"
    return None
