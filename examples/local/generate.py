"""Answer one chat message with a trained LoRA adapter, as any PEFT user would load it.

  python examples/local/generate.py ADAPTER_DIR "message" [--system "instructions"]

ADAPTER_DIR is what `tunewright download JOB` fetched (its `adapter/` folder): the adapter, the tokenizer
and a generation config that stops at the end of the assistant's turn. The base model is the one the
adapter names (adapter_config.json), loaded from where the job read it.
"""

import argparse

from peft import AutoPeftModelForCausalLM
from transformers import AutoTokenizer, GenerationConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("adapter")
    parser.add_argument("message")
    parser.add_argument("--system", help="a system message, as the training data had")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()

    model = AutoPeftModelForCausalLM.from_pretrained(args.adapter)
    tokenizer = AutoTokenizer.from_pretrained(args.adapter)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.message}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    # PEFT keeps the base model's generation config: the adapter's own says where a turn ends
    output = model.generate(**prompt, generation_config=GenerationConfig.from_pretrained(args.adapter),
                            max_new_tokens=args.max_new_tokens, do_sample=False)
    print(tokenizer.decode(output[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True).strip())


if __name__ == "__main__":
    main()
