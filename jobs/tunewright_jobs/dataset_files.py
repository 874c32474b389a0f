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


MISSING = object()  # a key the record does not have (null is a value, and a wrong one)


def _check_messages(messages, where: str, roles: set[str] = CHAT_ROLES) -> str | None:
    if messages is MISSING:
        return f'"{where}" is missing'
    if not isinstance(messages, list) or not messages:
        return f'"{where}" must be a non-empty list'
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            return f"{where}[{i}] must be an object"
        if msg.get("role") not in roles:
            return f"{where}[{i}].role must be one of {sorted(roles)}, got {msg.get('role')!r}"
        if not isinstance(msg.get("content"), str):
            return f"{where}[{i}].content must be a string"
    return None


def _check_chat(record: dict) -> str | None:
    if problem := _check_messages(record.get("messages", MISSING), "messages"):
        return problem
    if not any(m["role"] == "assistant" for m in record["messages"]):
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


OPENAI_PREFERENCE_KEYS = ("input", "preferred_output", "non_preferred_output")
PREFERENCE_KEYS = ("prompt", "chosen", "rejected")


def _check_answer(record: dict, key: str, conversational: bool) -> str | None:
    """A preferred or rejected answer: text, or (after a prompt of messages) assistant messages."""
    if key not in record:
        return f'"{key}" is missing'
    answer = record[key]
    if isinstance(answer, list) and conversational:
        return _check_messages(answer, key, {"assistant"})
    if isinstance(answer, list):
        return f'"{key}" is a list of messages, which needs "prompt" as a list of messages too (or "{key}" as text)'
    if not isinstance(answer, str) or not answer:
        return f'"{key}" must be a non-empty string' + (" or a list of assistant messages" if conversational else "")
    return None


def _check_preference(record: dict) -> str | None:
    """OpenAI's preference shape, or the prompt/chosen/rejected one (TRL's), text or messages."""
    if any(key in record for key in OPENAI_PREFERENCE_KEYS):
        prompt = record.get("input")
        if not isinstance(prompt, dict):
            return '"input" must be an object with "messages"'
        if problem := _check_messages(prompt.get("messages", MISSING), "input.messages"):
            return problem
        return next(filter(None, (_check_messages(record.get(key, MISSING), key, {"assistant"})
                                  for key in OPENAI_PREFERENCE_KEYS[1:])), None)
    if not any(key in record for key in PREFERENCE_KEYS):
        return ('a preference pair needs "input", "preferred_output" and "non_preferred_output" (OpenAI\'s shape) '
                'or "prompt", "chosen" and "rejected"')
    prompt = record.get("prompt")
    conversational = isinstance(prompt, list)
    if conversational:
        if problem := _check_messages(prompt, "prompt"):
            return problem
    elif not isinstance(prompt, str):
        return '"prompt" must be a string or a list of messages'
    return next(filter(None, (_check_answer(record, key, conversational) for key in PREFERENCE_KEYS[1:])), None)


_CHECKS = {"chat": _check_chat, "prompt_completion": _check_prompt_completion, "text": _check_text,
           "preference": _check_preference}


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
    openai_prompt = record.get("input")
    fields = [record.get(key) for key in ("messages", "completion", "text", *PREFERENCE_KEYS,
                                          *OPENAI_PREFERENCE_KEYS[1:])]
    fields.append(openai_prompt.get("messages") if isinstance(openai_prompt, dict) else None)
    # a field is text, or messages whose contents are
    parts = fields + [m.get("content") for field in fields if isinstance(field, list) for m in field]
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
