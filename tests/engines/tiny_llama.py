"""A tiny random-weight Llama in GGUF, with a locally trained byte-level BPE tokenizer.

No model can be downloaded here, so the engine tests make one: a tokenizer trained with
`tokenizers` on the Python standard library's own sources, and random f16 weights written with
`gguf`, with full tokenizer metadata and a ChatML chat template. The output rows of the EOS and
control tokens are zero, so generations run to max_tokens. About 30M parameters, 60 MB, seconds.

    python tests/engines/tiny_llama.py OUT.gguf
"""
from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

import numpy as np

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def corpus(limit_bytes: int = 8_000_000) -> list[str]:
    texts, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(errors="ignore")
        texts.append(text)
        size += len(text)
        if size > limit_bytes:
            break
    return texts


def train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def write(path: Path, d: int = 512, layers: int = 8, heads: int = 8, ff: int = 1408, vocab_size: int = 8192, seed: int = 0) -> Path:
    import gguf

    tok = train_tokenizer(vocab_size)
    vocab = tok.get_vocab()
    n_vocab = max(vocab.values()) + 1
    tokens = [""] * n_vocab
    for piece, index in vocab.items():
        tokens[index] = piece
    types = [gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens]
    import json

    merges = [" ".join(m) if isinstance(m, (list, tuple)) else m for m in json.loads(tok.to_str())["model"]["merges"]]
    eos, bos = vocab["<|im_end|>"], vocab["<|endoftext|>"]

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama-test")
    w.add_context_length(4096)
    w.add_embedding_length(d)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_rope_dimension_count(d // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)

    rng = np.random.default_rng(seed)
    f16 = lambda *shape: (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)  # noqa: E731
    w.add_tensor("token_embd.weight", f16(n_vocab, d))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(d, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(f"blk.{i}.{name}.weight", f16(d, d))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(d, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", f16(ff, d))
        w.add_tensor(f"blk.{i}.ffn_up.weight", f16(ff, d))
        w.add_tensor(f"blk.{i}.ffn_down.weight", f16(d, ff))
    w.add_tensor("output_norm.weight", np.ones(d, dtype=np.float32))
    output = f16(n_vocab, d) * np.float16(10)  # larger logits than the zero rows below
    for index, piece in enumerate(tokens):
        if piece in SPECIALS:
            output[index] = 0  # never chosen: generations run to max_tokens
    w.add_tensor("output.weight", output)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


if __name__ == "__main__":
    print(write(Path(sys.argv[1])))
