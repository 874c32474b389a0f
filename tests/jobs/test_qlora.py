"""QLoRA: LoRA on a base whose linear layers are loaded in 4-bit NF4 (bitsandbytes' CPU backend runs the same
codes as its CUDA one). It learns, its adapter loads with PEFT onto a 4-bit base, and its merged export (the
base dequantized, the adapter folded in, bf16) computes what adapter-on-4-bit computes."""

import re

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.jobs.conftest import make_config
from tunewright_jobs.config import ConfigError, JobConfig
from tunewright_jobs.evaluate import validation_metrics
from tunewright_jobs.model import keep_codes_as_trained, nf4_config
from tunewright_jobs.parallel import Dist
from tunewright_jobs.run import train_without_ray
from tunewright_jobs.train import preflight

bnb = pytest.importorskip("bitsandbytes", reason="the jobs extra installs it; a GPU image may lack it")
CPU = Dist(0, 1, 0, torch.device("cpu"))
# A CPU run computes in fp32, and its merged export is fp32: it differs from adapter-on-4-bit by the order of the
# sums alone (3e-5 measured). A GPU run's export is bf16, which rounds each weight by up to 2^-9 of itself: on
# the tiny Llama (weights drawn 10x wider than a real model's) that moves the logits by up to 10% of their spread.
MERGED_LOGITS_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def qlora_run(tiny_models, tmp_path_factory) -> tuple[JobConfig, dict]:
    cfg = make_config(tiny_models["llama"], tmp_path_factory.mktemp("qlora"),
                      method={"lora": {"quantization": "nf4"}}, hyperparameters={"max_steps": 30},
                      checkpoint={"export_merged": True})
    return cfg, train_without_ray(cfg)


def four_bit_base(source) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(source, quantization_config=nf4_config(torch.float32),
                                                 device_map={"": "cpu"}, dtype=torch.float32)
    keep_codes_as_trained(model)  # the tiny models' widths are not bitsandbytes' CPU inference layout's
    return model


def test_qlora_trains_on_a_four_bit_base(qlora_run):
    cfg, result = qlora_run
    assert result["eval_after"]["val_loss"] < 0.5 * result["eval_before"]["val_loss"]


def test_the_base_is_four_bit_and_only_the_adapters_train(tiny_models, tmp_path):
    from tunewright_jobs.model import load_model

    cfg = make_config(tiny_models["llama"], tmp_path, method={"lora": {"quantization": "nf4"}})
    model = load_model(cfg)
    quantized = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized) == 7 * model.config.num_hidden_layers  # every block's linear layer; not the head
    assert all(m.weight.quant_state.quant_type == "nf4" and m.weight.quant_state.nested for m in quantized)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)


def test_the_adapter_loads_with_peft_onto_a_four_bit_base(qlora_run, tiny_models):
    cfg, result = qlora_run
    tokenizer = AutoTokenizer.from_pretrained(result["export"]["adapter"])
    reloaded = PeftModel.from_pretrained(four_bit_base(tiny_models["llama"]), result["export"]["adapter"]).eval()
    again = validation_metrics(reloaded, preflight(cfg).val_rows, CPU, 4, tokenizer.pad_token_id, max_batches=4)
    assert again["val_loss"] == pytest.approx(result["eval_after"]["val_loss"], rel=1e-4)


def test_the_merged_export_is_the_dequantized_base_with_the_adapter_folded_in(qlora_run, tiny_models):
    cfg, result = qlora_run
    merged = AutoModelForCausalLM.from_pretrained(result["export"]["merged"]).eval()
    assert merged.dtype == torch.float32 and not getattr(merged.config, "quantization_config", None)
    adapter = PeftModel.from_pretrained(four_bit_base(tiny_models["llama"]), result["export"]["adapter"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(result["export"]["adapter"])
    ids = torch.tensor([tokenizer("The soup was cold and the staff were lovely.")["input_ids"]])
    with torch.no_grad():
        want = adapter(ids).logits
        got = merged(ids).logits
        base = four_bit_base(tiny_models["llama"])(ids).logits
    spread = want.std().item()
    assert (got - want).abs().max().item() < MERGED_LOGITS_TOLERANCE * spread
    # the adapter is in it: without it the logits are further off than the merge's rounding
    assert (base - want).abs().max().item() > 5 * (got - want).abs().max().item()


def test_gpt2s_conv1d_layers_merge_as_they_compute(tiny_models, tmp_path):
    """GPT-2 keeps its weights as (in, out) (Conv1D); transformers quantizes them transposed, so the merged
    export turns them back, square ones (attn.c_proj) included."""
    cfg = make_config(tiny_models["gpt2"], tmp_path, method={"lora": {"quantization": "nf4"}},
                      hyperparameters={"max_steps": 5}, checkpoint={"export_merged": True})
    result = train_without_ray(cfg)
    merged = AutoModelForCausalLM.from_pretrained(result["export"]["merged"]).eval()
    adapter = PeftModel.from_pretrained(four_bit_base(tiny_models["gpt2"]), result["export"]["adapter"]).eval()
    ids = torch.tensor([[5, 17, 33, 101, 7, 64, 12]])
    with torch.no_grad():
        want, got = adapter(ids).logits, merged(ids).logits
    assert (got - want).abs().max().item() < MERGED_LOGITS_TOLERANCE * want.std().item()


def test_a_failed_merge_still_publishes_the_adapter(tiny_models, tmp_path, monkeypatch):
    from tunewright_jobs import export

    def fails(*args):
        raise RuntimeError("no room")

    monkeypatch.setattr(export, "merge_dequantized", fails)
    cfg = make_config(tiny_models["llama"], tmp_path, method={"lora": {"quantization": "nf4"}},
                      hyperparameters={"max_steps": 2}, checkpoint={"export_merged": True})
    with pytest.raises(RuntimeError, match="no room"):
        train_without_ray(cfg)
    final = tmp_path / "final"
    assert (final / "adapter" / "adapter_model.safetensors").exists() and not (final / "merged").exists()
    assert not (tmp_path / "final.partial").exists()


def test_a_checkpoint_saved_in_four_bits_trains_as_a_four_bit_base_only(tiny_models, tmp_path):
    from tunewright_jobs.model import load_model

    saved = tmp_path / "llama-bnb-4bit"
    four_bit_base(tiny_models["llama"]).save_pretrained(saved)
    AutoTokenizer.from_pretrained(tiny_models["llama"]).save_pretrained(saved)
    with pytest.raises(ValueError, match="is saved in 4 bits .bitsandbytes.: train it as a 4-bit base"):
        load_model(make_config(saved, tmp_path / "bf16"))
    model = load_model(make_config(saved, tmp_path / "nf4", method={"lora": {"quantization": "nf4"}}))
    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules()) == 7 * model.config.num_hidden_layers


@pytest.mark.parametrize(("overrides", "message"), [
    ({"method": {"type": "full", "lora": {"quantization": "nf4"}}}, "method.type full trains every weight"),
    ({"strategy": {"type": "fsdp"}}, "strategy.type: a 4-bit (nf4) base is not sharded"),
])
def test_a_four_bit_base_refuses_what_it_cannot_run(tiny_models, tmp_path, overrides, message):
    overrides.setdefault("method", {"lora": {"quantization": "nf4"}})
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_config(tiny_models["llama"], tmp_path, **overrides)
