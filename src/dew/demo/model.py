"""Tiny models and a local character tokenizer for the demo, tests and benchmarks.

Nothing here downloads anything: the tokenizer is built from a fixed character set
and models are built from a config with random weights. Real users pass a
checkpoint path to ``transformers`` instead.
"""

from __future__ import annotations

import string
from typing import Any

SPECIAL = ["<pad>", "<unk>", "<bos>", "<eos>", "<|im_start|>", "<|im_end|>"]
CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"

# A ChatML-style template: each turn is "<|im_start|>role\ncontent<|im_end|>\n".
# Turn k's rendering is a prefix of turn k+1's, so multi-turn calls merge into one chain.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer() -> Any:
    """A character-level ``PreTrainedTokenizerFast`` with a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + list(CHARS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<bos>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<eos>", "<|im_start|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


ARCHS = ("qwen2", "llama")

SIZES = {
    # name: (hidden, layers, heads, kv_heads, intermediate)
    "tiny": (64, 2, 4, 2, 128),
    # The smallest shape vLLM's CPU attention serves: heads of 64 dimensions.
    "tiny64": (128, 2, 2, 2, 256),
    "small": (128, 4, 4, 2, 384),
    "base": (256, 6, 8, 4, 768),
}


def make_model(
    arch: str = "qwen2", size: str = "tiny", *, seed: int = 0, max_positions: int = 1024
) -> Any:
    """A randomly initialized causal LM (``qwen2`` or ``llama``) over the demo vocabulary."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if size not in SIZES:
        raise ValueError(f"size={size!r} is not one of {sorted(SIZES)}")
    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r} is not one of ['llama', 'qwen2']")
    hidden, layers, heads, kv, inter = SIZES[size]
    vocab = len(SPECIAL) + len(CHARS)
    config = AutoConfig.for_model(
        arch,
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=inter,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=SPECIAL.index("<pad>"),
        bos_token_id=SPECIAL.index("<bos>"),
        eos_token_id=SPECIAL.index("<|im_end|>"),
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.float().eval()
