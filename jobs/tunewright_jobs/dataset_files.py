"""Dataset files: reading a JSONL file and checking every record against its format.

Standard library only: the API runs the validator (`validate.py`) at upload in an environment without
numpy or torch.
"""

from __future__ import annotations

import json
from pathlib import Path

MAX_REPORTED_ERRORS = 20
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


def read_jsonl(path: str | Path, fmt: str) -> list[dict]:
    """Every record of a JSONL file, or a DatasetError listing the first bad lines."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    check = _CHECKS[fmt]
    records, errors = [], []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                problem = "must be a JSON object" if not isinstance(record, dict) else check(record)
            except json.JSONDecodeError as err:
                problem = f"not valid JSON ({err.msg} at column {err.colno})"
            if problem:
                errors.append(f"{path}:{lineno}: {problem}")
            else:
                records.append(record)
            if len(errors) >= MAX_REPORTED_ERRORS:
                errors.append("(stopped after the first errors)")
                break
    if errors:
        raise DatasetError(f"dataset rejected (format {fmt}):\n  " + "\n  ".join(errors))
    if not records:
        raise DatasetError(f"{path}: no examples")
    return records
