"""A tiny random-weight Llama in Hugging Face format, for vLLM on CPU (no download).

The tokenizer is the same locally trained byte-level BPE as tiny_llama.py, wrapped as a fast
tokenizer with a ChatML template; the weights are random, saved with transformers.

    python tests/engines/tiny_hf.py OUT_DIR        # run with the vLLM environment's Python
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_llama import CHATML, SPECIALS, train_tokenizer  # noqa: E402


def write(out: Path, vocab_size: int = 8192) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = train_tokenizer(vocab_size)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(out)
    vocab = tok.get_vocab()
    config = LlamaConfig(vocab_size=max(vocab.values()) + 1, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096,
                         bos_token_id=vocab["<|endoftext|>"], eos_token_id=vocab["<|im_end|>"], tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for piece in SPECIALS:  # never generated: generations run to max_tokens
            model.lm_head.weight[vocab[piece]] = 0
        model.lm_head.weight.mul_(10)
    model.save_pretrained(out)
    return out


if __name__ == "__main__":
    print(write(Path(sys.argv[1])))
