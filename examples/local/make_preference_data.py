"""Preference pairs for the DPO example, from the tiny kit's sentiment data (deterministic: no randomness).

  python examples/local/make_preference_data.py [--out examples/local/data]

Each review the kit labels becomes a pair: the prompt is its system and user messages, the chosen answer the
right label, the rejected answer the wrong one. The training file is in OpenAI's shape (input, preferred_output,
non_preferred_output), the validation file in the prompt/chosen/rejected shape (a prompt of messages): dataset
format preference takes either. 200 training pairs (every 4th of the kit's 800 reviews), 50 validation pairs
(every 2nd of its 100).
"""

import argparse
import json
from pathlib import Path

from tunewright_jobs.tiny import DATA_DIR

LABELS = ("positive", "negative")
TRAIN_EVERY, VALIDATION_EVERY = 4, 2


def pairs(source: Path, every: int) -> list[tuple[list[dict], str, str]]:
    """(prompt messages, chosen, rejected) for every `every`-th record of a chat file of the kit's."""
    out = []
    for index, line in enumerate(source.read_text().splitlines()):
        if index % every:
            continue
        messages = json.loads(line)["messages"]
        prompt, answer = messages[:-1], messages[-1]["content"]
        assert answer in LABELS, f"{source}:{index + 1}: not a sentiment label: {answer!r}"
        out.append((prompt, answer, LABELS[1 - LABELS.index(answer)]))
    return out


def openai_shape(prompt: list[dict], chosen: str, rejected: str) -> dict:
    return {"input": {"messages": prompt}, "preferred_output": [{"role": "assistant", "content": chosen}],
            "non_preferred_output": [{"role": "assistant", "content": rejected}]}


def prompt_chosen_rejected(prompt: list[dict], chosen: str, rejected: str) -> dict:
    return {"prompt": prompt, "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}]}


def write(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"{path}: {len(records)} pairs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "data")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    write(args.out / "preference-train.jsonl",
          [openai_shape(*pair) for pair in pairs(DATA_DIR / "train.jsonl", TRAIN_EVERY)])
    write(args.out / "preference-validation.jsonl",
          [prompt_chosen_rejected(*pair) for pair in pairs(DATA_DIR / "validation.jsonl", VALIDATION_EVERY)])


if __name__ == "__main__":
    main()
