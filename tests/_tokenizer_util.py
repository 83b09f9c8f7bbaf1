"""Shared by the data and Hugging Face tests: a small byte-level BPE tokenizer.json with an
<|endoftext|> special token, trained here (no download), and a few text documents."""

from pathlib import Path

from tests._prereq import need

TEXTS = [f"def f{i}(x):\n    return x * {i}\n" for i in range(200)]


def make_bpe(root: Path, vocab_size: int = 300) -> tuple[Path, Path]:
    """(tokenizer.json path, a folder of 5 documents) under `root`."""
    tokenizers = need("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS, trainer)
    path = root / "tok" / "tokenizer.json"
    path.parent.mkdir(parents=True)
    tok.save(str(path))
    docs = root / "docs"
    docs.mkdir()
    for i in range(5):
        (docs / f"{i}.py").write_text("".join(TEXTS[i * 40:(i + 1) * 40]))
    return path, docs
