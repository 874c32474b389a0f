"""`python -m tunewright_jobs.validate FILE [--format auto|chat|prompt_completion|text|preference]`: check a dataset.

Prints one JSON object: {"format", "examples", "characters", "longest_characters"} on success (exit 0), {"format", "errors": [...]} on failure
(exit 1). The API calls this at upload, so that one validator (the runtime's) decides what trains.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tunewright_jobs.dataset_files import DatasetError, dataset_stats

# preference before prompt_completion: the prompt/chosen/rejected shape has a "prompt" too
FORMAT_KEYS = (("messages", "chat"), ("preferred_output", "preference"), ("chosen", "preference"),
               ("completion", "prompt_completion"), ("prompt", "prompt_completion"), ("text", "text"))


def detect_format(path: Path) -> str | None:
    """The format named by the first record's keys, or None when the first line says nothing."""
    with path.open(encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                return None
            if isinstance(record, dict):
                return next((fmt for key, fmt in FORMAT_KEYS if key in record), None)
            return None
    return None


def validate(path: Path, fmt: str) -> dict:
    if fmt == "auto":
        fmt = detect_format(path)
        if fmt is None:
            return {"format": None, "errors": [f"{path.name}:1: cannot tell the format: the first record needs "
                                               '"messages" (chat), "prompt"/"completion", "text", or '
                                               '"chosen"/"preferred_output" (preference)']}
    try:
        stats = dataset_stats(path, fmt)
    except DatasetError as err:
        lines = str(err).splitlines()
        return {"format": fmt, "errors": [line.strip() for line in lines[1:]] or lines}
    return {"format": fmt, "examples": stats.examples, "characters": stats.characters,
            "longest_characters": stats.longest_characters}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", type=Path)
    parser.add_argument("--format", default="auto", choices=["auto", "chat", "prompt_completion", "text", "preference"])
    args = parser.parse_args(argv)
    result = validate(args.file, args.format)
    print(json.dumps(result))
    return 1 if "errors" in result else 0


if __name__ == "__main__":
    sys.exit(main())
