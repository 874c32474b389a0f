"""Dataset files: reading a JSONL file and checking every record against its format.

Standard library only: the API runs the validator (`validate.py`) at upload in an environment without
numpy or torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

MAX_REPORTED_ERRORS = 20
MAX_LINE_BYTES = 16 * 2**20  # one example; a longer line is refused, not read into memory
CHAT_ROLES = {"system", "user", "assistant", "tool"}


class DatasetError(ValueError):
    """A dataset that cannot be used; the message names the file, the line and the reason."""


def _check_chat(record: dict) -> str | None:
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        return '"messages" must be a non-empty list'
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            return f"messages[{i}] must be an object"
        if msg.get("role") not in CHAT_ROLES:
            return f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {msg.get('role')!r}"
        if not isinstance(msg.get("content"), str):
            return f"messages[{i}].content must be a string"
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant message: nothing to learn from"
    return None


def _check_prompt_completion(record: dict) -> str | None:
    if not isinstance(record.get("prompt"), str):
        return '"prompt" must be a string'
    if not isinstance(record.get("completion"), str) or not record["completion"]:
        return '"completion" must be a non-empty string'
    return None


def _check_text(record: dict) -> str | None:
    if not isinstance(record.get("text"), str) or not record["text"]:
        return '"text" must be a non-empty string'
    return None


_CHECKS = {"chat": _check_chat, "prompt_completion": _check_prompt_completion, "text": _check_text}


def _scan(path: Path, fmt: str):
    """(line number, record, problem) for every non-blank line, read as bytes one bounded line at a time:
    a line that is not UTF-8 or is longer than MAX_LINE_BYTES is a problem of that line, never a crash."""
    check = _CHECKS[fmt]
    with path.open("rb") as fh:
        lineno = 0
        while raw := fh.readline(MAX_LINE_BYTES + 1):
            lineno += 1
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                while (rest := fh.readline(MAX_LINE_BYTES)) and not rest.endswith(b"\n"):
                    pass  # the rest of the over-long line: skipped, not held
                yield lineno, None, f"longer than {MAX_LINE_BYTES} bytes"
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield lineno, None, f"not UTF-8 text (byte {err.start + 1} of the line)"
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                problem = "must be a JSON object" if not isinstance(record, dict) else check(record)
            except json.JSONDecodeError as err:
                problem = f"not valid JSON ({err.msg} at character {err.pos + 1})"
                record = None
            yield lineno, None if problem else record, problem


def text_characters(record: dict) -> int:
    """The characters of text a (valid) record holds, whatever its format."""
    parts = [m.get("content") for m in record.get("messages") or []] + [record.get(k) for k in ("prompt",
                                                                                                "completion", "text")]
    return sum(len(p) for p in parts if isinstance(p, str))


@dataclass(frozen=True)
class DatasetStats:
    examples: int
    characters: int  # of text, in every example
    longest_characters: int  # of text, in the longest example


def _read(path: str | Path, fmt: str, keep: bool) -> tuple[list[dict], DatasetStats]:
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    records, count, errors, characters, longest = [], 0, [], 0, 0
    for lineno, record, problem in _scan(path, fmt):
        if problem:
            errors.append(f"{path}:{lineno}: {problem}")
            if len(errors) >= MAX_REPORTED_ERRORS:
                errors.append("(stopped after the first errors)")
                break
        else:
            count += 1
            size = text_characters(record)
            characters, longest = characters + size, max(longest, size)
            if keep:
                records.append(record)
    if errors:
        raise DatasetError(f"dataset rejected (format {fmt}):\n  " + "\n  ".join(errors))
    if not count:
        raise DatasetError(f"{path}: no examples")
    return records, DatasetStats(count, characters, longest)


def read_jsonl(path: str | Path, fmt: str) -> list[dict]:
    """Every record of a JSONL file, or a DatasetError listing the first bad lines."""
    return _read(path, fmt, keep=True)[0]


def dataset_stats(path: str | Path, fmt: str) -> DatasetStats:
    """How many good records a JSONL file holds and how much text (checked as `read_jsonl` does, none kept in
    memory): enough for the API to choose sizes the data can fill before any tokenizer is loaded."""
    return _read(path, fmt, keep=False)[1]
