"""Answer one chat message with a trained LoRA adapter, loaded as Transformers loads any PEFT adapter.

  python examples/local/generate.py ADAPTER_DIR "message" [--system "instructions"]

ADAPTER_DIR is what `tunewright download JOB` fetched (its `adapter/` folder): the adapter, the tokenizer
and a generation config that stops at the end of the assistant's turn. The base model is the one the
adapter names (adapter_config.json), loaded from where the job read it (PEFT must be installed).
"""

import argparse

from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("adapter")
    parser.add_argument("message")
    parser.add_argument("--system", help="a system message, as the training data had")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()

    model = AutoModelForCausalLM.from_pretrained(args.adapter)  # the base model, with the adapter on it
    tokenizer = AutoTokenizer.from_pretrained(args.adapter)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.message}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    # the adapter's generation config says where a turn ends (the base model's does not); settings go in it
    generation = GenerationConfig.from_pretrained(args.adapter, max_new_tokens=args.max_new_tokens,
                                                  do_sample=False)
    output = model.generate(**prompt, generation_config=generation)
    print(tokenizer.decode(output[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True).strip())


if __name__ == "__main__":
    main()
