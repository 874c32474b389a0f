"""The first hour: examples/local/generate.py, the README's last step, answers without a deprecation warning."""

import subprocess
import sys
from pathlib import Path

import pytest

from tunewright_jobs.data import end_of_turn_id, ensure_chat_template

ROOT = Path(__file__).resolve().parents[2]


# PEFT's wrapper reads a property transformers deprecates: here, making the adapter, not in generate.py
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.slow  # loads a model and generates: ~8 s, more on a busy machine
def test_generate_runs_without_deprecation_warnings(tiny_models, tmp_path):
    """An adapter folder as `tunewright download` fetches it (the adapter, the tokenizer, a generation config
    that stops at the end of a turn), untrained: the answer is noise, what matters is that nothing warns."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter = tmp_path / "adapter"
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_models["gpt2"]),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                      fan_in_fan_out=True, task_type="CAUSAL_LM"))
    model.save_pretrained(adapter)
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["gpt2"])
    ensure_chat_template(tokenizer)  # as the run does: the tiny GPT-2's tokenizer has none of its own
    tokenizer.save_pretrained(adapter)
    generation = model.base_model.model.generation_config
    generation.eos_token_id = [end_of_turn_id(tokenizer), tokenizer.eos_token_id]
    generation._from_model_config = False
    generation.save_pretrained(adapter)

    done = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-W", "error::FutureWarning",
                           str(ROOT / "examples/local/generate.py"), str(adapter), "The bed felt dirty.",
                           "--system", "Classify the sentiment.", "--max-new-tokens", "4"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Warning" not in done.stderr and "deprecated" not in done.stderr, done.stderr[-3000:]
