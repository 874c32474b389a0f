"""Model profiles: the shapes the planner needs, from a config.json, a job spec, or a built-in catalog."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelProfile:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied_embeddings: bool
    gated_mlp: bool = True  # SwiGLU/GeGLU (three matrices) vs GPT-2's two
    max_positions: int = 0  # learned position embeddings (GPT-2); 0 for RoPE models
    head_dim_override: int = 0  # when heads x head_dim != hidden (Gemma 2)
    model_type: str = ""  # config.json's; it names the modules LoRA can target ("": not known here)

    @property
    def family(self) -> str:
        """Kernel behaviour class for calibration: GPT-2's unfused blocks, or a Llama-style gated block."""
        return "llama" if self.gated_mlp else "gpt2"

    @property
    def linear_module_names(self) -> frozenset[str]:
        """The names of the linear modules LoRA can adapt (empty: an architecture this table does not know)."""
        return LINEAR_MODULES.get(self.model_type, frozenset())

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden // self.heads

    @property
    def layer_linear_params(self) -> int:
        """Weights of one decoder block's matrices (biases and norms are negligible and ignored)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * (q + 2 * kv) + q * self.hidden
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.ffn
        return attention + mlp

    @property
    def linear_modules_per_layer(self) -> int:
        """LoRA `all-linear` targets per block (GPT-2 fuses q, k, v into one matrix)."""
        return 7 if self.gated_mlp else 4

    @property
    def params_outside_blocks(self) -> int:
        """Embeddings (token and learned position), the output head when untied, and the final norm: what the
        runtime's root FSDP unit holds, apart from the decoder blocks."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2) + (self.max_positions + 1) * self.hidden

    @property
    def params(self) -> int:
        return self.layers * (self.layer_linear_params + 2 * self.hidden) + self.params_outside_blocks

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matrix product per token: every block and the output head."""
        return self.layers * self.layer_linear_params + self.vocab * self.hidden

    @property
    def linear_shapes(self) -> list[tuple[int, int]]:
        """(inputs, outputs) of each linear layer of a block: q, k, v, o, gate, up, down (GPT-2: c_attn, c_proj,
        c_fc, mlp.c_proj)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, f = self.hidden, self.ffn
        if self.gated_mlp:
            return [(h, q), (h, kv), (h, kv), (q, h), (h, f), (h, f), (f, h)]
        return [(h, h + 2 * kv), (h, h), (h, f), (f, h)]

    def lora_params(self, rank: int) -> int:
        """(in + out) x r for each adapted layer."""
        return self.layers * rank * sum(i + o for i, o in self.linear_shapes)

    def flops_per_token(self, seq_len: int, method: str, objective: str = "sft") -> float:
        """Model FLOPs per trained token (docs/reference.md, "FLOPs and time"): 6Ψ + 12·L·h·s full, 4Ψ + 12·L·h·s LoRA;
        dpo adds the reference's forward of every trained token (chosen and rejected): 2Ψ + 4·L·h·s."""
        flops = (6 if method == "full" else 4) * self.params + 12 * self.layers * self.hidden * seq_len
        if objective == "dpo":
            flops += 2 * self.params + 4 * self.layers * self.hidden * seq_len
        return flops


_LLAMA_LINEAR = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"})
LINEAR_MODULES: dict[str, frozenset[str]] = {
    "gpt2": frozenset({"c_attn", "c_proj", "c_fc", "lm_head"}),
    **dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"), _LLAMA_LINEAR),
    "phi3": frozenset({"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}),
}


def from_hf_config(name: str, config: dict) -> ModelProfile:
    """A profile from a Hugging Face config.json (Llama, Qwen2, Mistral, Gemma, Phi-3 and GPT-2 layouts)."""
    if config.get("model_type") == "gpt2" or "n_embd" in config:
        hidden = config["n_embd"]
        return ModelProfile(name, config["n_layer"], hidden, config["n_head"], config["n_head"],
                            config.get("n_inner") or 4 * hidden, config["vocab_size"], True, gated_mlp=False,
                            max_positions=config.get("n_positions", 1024), model_type="gpt2")
    try:
        heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        head_dim = config.get("head_dim") or hidden // heads
        return ModelProfile(name, config["num_hidden_layers"], hidden, heads,
                            config.get("num_key_value_heads") or heads, config["intermediate_size"],
                            config["vocab_size"], bool(config.get("tie_word_embeddings", False)),
                            head_dim_override=head_dim if head_dim * heads != hidden else 0,
                            model_type=str(config.get("model_type") or ""))
    except KeyError as missing:
        raise ValueError(f"model config.json of {name} lacks {missing}: cannot profile it") from None


def hf_config(profile: ModelProfile) -> dict:
    """The config.json shape fields of a profile (GPT-2 or Llama layout): `from_hf_config` reads them back."""
    p = profile
    if not p.gated_mlp:
        return {"model_type": p.model_type or "gpt2", "n_layer": p.layers, "n_embd": p.hidden, "n_head": p.heads,
                "vocab_size": p.vocab, "n_positions": p.max_positions,
                **({"n_inner": p.ffn} if p.ffn != 4 * p.hidden else {})}
    return {"model_type": p.model_type or "llama", "num_hidden_layers": p.layers, "hidden_size": p.hidden,
            "num_attention_heads": p.heads, "num_key_value_heads": p.kv_heads, "intermediate_size": p.ffn,
            "vocab_size": p.vocab, "tie_word_embeddings": p.tied_embeddings,
            **({"head_dim": p.head_dim} if p.head_dim_override else {})}


def _gpt2(name, layers, hidden, heads):
    return ModelProfile(name, layers, hidden, heads, heads, 4 * hidden, 50257, True, gated_mlp=False,
                        max_positions=1024, model_type="gpt2")


def _llama(name, layers, hidden, heads, kv, ffn, vocab, tied=False, head_dim=0, model_type="llama"):
    return ModelProfile(name, layers, hidden, heads, kv, ffn, vocab, tied, head_dim_override=head_dim,
                        model_type=model_type)


CATALOG: dict[str, ModelProfile] = {p.name: p for p in [
    _gpt2("gpt2", 12, 768, 12),
    _gpt2("gpt2-medium", 24, 1024, 16),
    _gpt2("gpt2-large", 36, 1280, 20),
    _gpt2("gpt2-xl", 48, 1600, 25),
    _llama("meta-llama/Llama-3.2-1B", 16, 2048, 32, 8, 8192, 128256, tied=True),
    _llama("meta-llama/Llama-3.2-3B", 28, 3072, 24, 8, 8192, 128256, tied=True),
    _llama("meta-llama/Llama-3.1-8B", 32, 4096, 32, 8, 14336, 128256),
    _llama("meta-llama/Llama-3.1-70B", 80, 8192, 64, 8, 28672, 128256),
    _llama("Qwen/Qwen2.5-0.5B", 24, 896, 14, 2, 4864, 151936, tied=True, model_type="qwen2"),
    _llama("Qwen/Qwen2.5-1.5B", 28, 1536, 12, 2, 8960, 151936, tied=True, model_type="qwen2"),
    _llama("Qwen/Qwen2.5-3B", 36, 2048, 16, 2, 11008, 151936, tied=True, model_type="qwen2"),
    _llama("Qwen/Qwen2.5-7B", 28, 3584, 28, 4, 18944, 152064, model_type="qwen2"),
    _llama("Qwen/Qwen2.5-14B", 48, 5120, 40, 8, 13824, 152064, model_type="qwen2"),
    _llama("Qwen/Qwen2.5-32B", 64, 5120, 40, 8, 27648, 152064, model_type="qwen2"),
    _llama("Qwen/Qwen2.5-72B", 80, 8192, 64, 8, 29568, 152064, model_type="qwen2"),
    _llama("mistralai/Mistral-7B-v0.3", 32, 4096, 32, 8, 14336, 32768, model_type="mistral"),
    _llama("mistralai/Mistral-7B-v0.1", 32, 4096, 32, 8, 14336, 32000, model_type="mistral"),
    _llama("google/gemma-2-2b", 26, 2304, 8, 4, 9216, 256000, tied=True, head_dim=256, model_type="gemma2"),
    _llama("google/gemma-2-9b", 42, 3584, 16, 8, 14336, 256000, tied=True, head_dim=256, model_type="gemma2"),
    _llama("google/gemma-2-27b", 46, 4608, 32, 16, 36864, 256000, tied=True, head_dim=128, model_type="gemma2"),
    _llama("microsoft/Phi-3-mini-4k-instruct", 32, 3072, 32, 32, 8192, 32064, model_type="phi3"),
    _llama("microsoft/Phi-3-medium-4k-instruct", 40, 5120, 40, 10, 17920, 32064, model_type="phi3"),
]}


def lookup(source: str) -> ModelProfile | None:
    """The catalog entry for a model source (`hf://org/name`, `org/name`, or a bare GPT-2 size); none for a
    path or a volume, whatever its last part says: its own config.json says what it is."""
    if source.startswith(("/", ".", "~")) or ("://" in source and not source.startswith("hf://")):
        return None
    key = source.removeprefix("hf://").rstrip("/")
    if key in CATALOG:
        return CATALOG[key]
    by_name = {k.lower(): v for k, v in CATALOG.items()} | {base_name(k): v for k, v in CATALOG.items()}
    return by_name.get(key.lower()) or by_name.get(base_name(key))


# An instruct or chat variant has its base model's shapes: Llama-3.1-8B-Instruct, Mistral-7B-Instruct-v0.3,
# gemma-2-9b-it, Qwen2.5-7B-Instruct, Meta-Llama-3.1-8B (the older name).
_VARIANT = re.compile(r"-(instruct|chat|it)(?=-|$)", re.IGNORECASE)


def base_name(hub_id: str) -> str:
    return _VARIANT.sub("", hub_id.split("/")[-1]).lower().removeprefix("meta-")
