"""The data section: the token files of a run, or a mixture of prepared corpora
(`data.sources`), typed, documented and checked as the other sections are (`sections`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath

from ratrain.config.sections import _choice, _positive
from ratrain.config.typedyaml import ConfigError

@dataclass(frozen=True)
class DataSource:
    """One corpus of a mixture (data.sources): prepared as for data.tokens, blended by weight.

    tokens: its token file or Megatron prefix
    weight: its share of the training samples (the weights are divided by their sum)
    eval_tokens: its held-out file, for its own eval loss; "" = the val split beside tokens, if any
    name: its name in eval.jsonl (eval_loss/<name>); "" = the token file's folder when the file
        is train.bin (data/web/train.bin -> web), else the file's stem
    """
    tokens: str = ""
    weight: float = 1.0
    eval_tokens: str = ""
    name: str = ""

    def label(self) -> str:
        """The source's name: `name`, else derived from `tokens` (see above)."""
        if self.name:
            return self.name
        p = PurePath(self.tokens)
        stem = p.name.split(".")[0]
        return p.parent.name if stem == "train" and p.parent.name else stem

    def check(self, i: int) -> None:
        where = f"data.sources[{i}]"
        if not self.tokens:
            raise ConfigError(f"{where}.tokens is empty: give each source its token file")
        if not self.weight > 0:
            raise ConfigError(f"{where}.weight={self.weight} must be > 0 (its share of the "
                              "samples)")


@dataclass(frozen=True)
class DataConfig:
    """Token files (Megatron-LM's .bin + .idx, or a flat nanoGPT .bin) and the held-out eval.

    tokens: training token file or Megatron prefix; "" = the embedded default corpus (prepared
        on first use)
    order: sequential | shuffled windows of seq_len + 1 tokens
    seed: shuffle seed (order: shuffled)
    eval_tokens: held-out token file; "" = the val split beside tokens, if any
    eval_interval: steps between eval losses (written to eval.jsonl); 0 = never
    eval_batches: batches of the held-out file each eval reads (the same ones every time)
    tokenizer: the tokenizer of the token files: "byte" or a tokenizer.json path; "" = what the
        token file's sidecar records (filled in at start-up, carried to checkpoints and exports)
    tokenizer_sha256: SHA-256 of the tokenizer.json; "" = filled in at start-up; set: the file must
        match it
    sources: a mixture instead of tokens (see data.sources[] below): [{tokens: PATH, weight: W},
        ...], each sample from the source furthest behind its weight (Megatron-LM's blend),
        each source's eval loss in eval.jsonl; empty = tokens alone
    """
    tokens: str = ""  # token file; "" = the embedded default corpus (prepared on first use)
    order: str = "sequential"
    seed: int = 0
    eval_tokens: str = ""  # held-out token file; "" = the `.val` split beside `tokens`, if any
    eval_interval: int = 0  # steps between eval losses; 0 = never
    eval_batches: int = 4
    tokenizer: str = ""
    tokenizer_sha256: str = ""
    sources: tuple[DataSource, ...] = ()

    def check(self) -> None:
        _choice(self, "data", "order", ("sequential", "shuffled"))
        for key in ("seed", "eval_interval"):
            if getattr(self, key) < 0:
                raise ConfigError(f"data.{key}={getattr(self, key)} must be >= 0")
        _positive(self, "data", "eval_batches")
        if self.sources and (self.tokens or self.eval_tokens):
            key = "tokens" if self.tokens else "eval_tokens"
            raise ConfigError(f"data.{key}={getattr(self, key)!r} and data.sources are both "
                              f"set: a mixture names its files in data.sources[i].tokens (and "
                              f".eval_tokens); leave data.{key} empty")
        names = [s.label() for s in self.sources]
        for i, s in enumerate(self.sources):
            s.check(i)
            if names.index(names[i]) != i:
                raise ConfigError(f"data.sources[{i}] and data.sources[{names.index(names[i])}] "
                                  f"are both named {names[i]!r}: give them names (data.sources"
                                  "[i].name)")


__all__ = ["DataConfig", "DataSource"]
