"""The built-in `tiny` model: a small Llama-architecture model and a byte-level tokenizer.

It is the embedded default of `memfit train`: it trains to a visibly falling loss on
the bundled corpus in about a minute on two CPU cores, with nothing to download.
"""

from __future__ import annotations

from pathlib import Path

from transformers import LlamaConfig, PreTrainedTokenizerFast

from memfit.checkpoint_files.pretrained import save_pretrained

EOS_TOKEN = "<|endoftext|>"


def tiny_config(vocab_size: int = 257, max_positions: int = 1024, **config_fields) -> LlamaConfig:
    """About 3M parameters: 4 layers of width 256 with grouped-query attention.

    `config_fields` (any LlamaConfig field) change the shape; they are passed to the
    constructor, so derived fields such as `head_dim` follow them.
    """
    return LlamaConfig(**{
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": vocab_size - 1,
        "eos_token_id": vocab_size - 1,
        "pad_token_id": vocab_size - 1,
        **config_fields,
    })


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: 256 byte tokens plus one end-of-text token (id 256).

    Built with the `tokenizers` library, so it saves and loads with AutoTokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: index for index, symbol in enumerate(alphabet)}
    vocab[EOS_TOKEN] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    tokenizer.fingerprint = "memfit-byte-v1"  # stable cache key for tokenized data
    return tokenizer


def save_llama(directory: str | Path, seed: int = 0, **config_fields) -> Path:
    """A randomly initialised Llama with the byte tokenizer, saved where the real loading code reads it.

    The shape is `tiny_config`'s with `config_fields` (any LlamaConfig field) changed; the
    special tokens are the byte tokenizer's end-of-text id (256). For tests and
    benchmarks that need a model of a given shape on disk without downloading one.
    """
    import torch
    from transformers import LlamaForCausalLM

    config = tiny_config(vocab_size=config_fields.pop("vocab_size", 257),
                         max_positions=config_fields.pop("max_position_embeddings", 4096),
                         **{"bos_token_id": 256, "eos_token_id": 256, "pad_token_id": 256, **config_fields})
    torch.manual_seed(seed)
    directory = Path(directory)
    save_pretrained(LlamaForCausalLM(config), directory)
    byte_tokenizer().save_pretrained(directory)
    return directory
