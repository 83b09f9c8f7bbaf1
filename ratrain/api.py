"""Use a trained model from Python: load it, take logits, evaluate a checkpoint, generate text.

    from ratrain import api
    model = api.load("runs/tiny/checkpoints")      # newest committed checkpoint (or ckpt-000100,
                                                   # or a Hugging Face LLaMA directory)
    logits = model.logits(ids)                     # ids (B, T) ints -> (B, T, vocab) float32
    loss = model.loss(ids[:, :-1], ids[:, 1:])     # mean token cross-entropy (what training logs)
    out = model.generate(prompt_ids, 50, top_k=40, top_p=0.9, temperature=0.8, seed=0)
    text = model.complete("def main(", 50)         # the same with the run's tokenizer
    model.close()

    res = api.evaluate(cfg, comm, "runs/tiny/checkpoints")   # any pp x dp layout; collective

A `Model` is one process's rank at pp = dp = 1, built by `runtime.rank.build_rank` (the one
way to build a rank) with the checkpoint's masters loaded, no DDR cap and no pacing; its logits
run the block kernels (`exec.layers`, `exec.head`) on the executor's views: the same arithmetic
as training's forward, in the run's precision unless `precision=` says otherwise. `evaluate`
builds the rank of any layout and takes `Executor.eval_loss` over the eval batches: the very
numbers the training run's eval logs at that step.

Generation runs the whole context through the model for every new token (no KV cache: the
models ratrain trains here are small), cropping it to `model.seq_len` tokens; greedy
(`temperature=0`), or sampling with temperature, top-k and top-p (nucleus) filtering from a
seeded `numpy.random.Generator`; it stops at `max_new_tokens` or the tokenizer's end-of-text id.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from ratrain.checkpoint import checkpoint_config, committed_path, load_stage, verify_checkpoint
from ratrain.config import Config, ConfigError, ParallelConfig, replace
from ratrain.data import (
    DataError,
    TokenDataset,
    default_tokens_path,
    eval_batches,
    held_out_beside,
    load_tokenizer,
    resolve_tokens,
    val_path,
)
from ratrain.device import to_device, to_host
from ratrain.exec import head, layers
from ratrain.hf import CONFIG, import_model_section, load_hf_params
from ratrain.runtime.rank import build_rank


# --------------------------------------------------------------------------------------------
# One process: logits and generation
# --------------------------------------------------------------------------------------------


def _one_process(cfg: Config, precision: str | None, threads: int, device: str) -> Config:
    """`cfg` as one rank at pp = dp = 1 on `device` that only runs forward (no pacing, no auto
    recompute)."""
    return replace(
        cfg,
        precision=precision or cfg.precision,
        parallel=ParallelConfig(),
        schedule=replace(cfg.schedule, policy="baseline-1f1b", recompute="none"),
        platform=replace(cfg.platform, emulate=False),
        run=replace(cfg.run, threads=threads, trace=False, device=device),
    )


class Model:
    """A trained model in this process (see the module doc). Build it with `load`."""

    def __init__(self, cfg: Config, load_fn, *, step: int | None = None, source: str = "",
                 precision: str | None = None, threads: int = 0, tokenizer: str | None = None,
                 device: str = "cpu"):
        self.cfg = _one_process(cfg, precision, threads, device)
        self.cfg.run.check()
        self.step, self.source = step, source
        self.rank = build_rank(self.cfg, None, cap=None, load=load_fn)
        ex = self.rank.executor
        for b in ex.blocks:
            if not self.rank.state.has_view(b):
                ex.materialize_now(b)
        self._tok = None
        self._tok_spec = tokenizer

    @property
    def vocab_size(self) -> int:
        return self.cfg.model.vocab_size

    @property
    def seq_len(self) -> int:
        """The context the model was trained on (generation crops to it)."""
        return self.cfg.model.seq_len

    def _check(self, ids) -> np.ndarray:
        ids = np.asarray(ids)
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2 or ids.shape[1] < 1:
            raise ValueError(f"token ids of shape {ids.shape}: give (batch, tokens) or (tokens,)")
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise ValueError(f"token ids span [{ids.min()}, {ids.max()}], outside the vocabulary "
                             f"[0, {self.vocab_size})")
        return ids.astype(np.int64)

    def _hidden(self, ids: np.ndarray) -> np.ndarray:
        """The last layer's output (B, T, C) for ids (B, T): embed, then every layer."""
        compute, ctx = self.rank.executor.compute, self.rank.ctx
        x, _ = layers.embed_forward(to_device(ctx.xp, ids), compute.view("embed"), ctx)  # (B, T, C)
        for b in compute.blocks:
            if compute.role[b] == "layer":
                x, _ = layers.layer_forward(x, compute.view(b), ctx, "full")  # keeps only x
        return x

    def logits(self, ids, last_only: bool = False) -> np.ndarray:
        """Next-token logits, float32: (B, T, vocab) for ids (B, T) (or (T,)); with
        `last_only`, (B, vocab) of the last position."""
        ids = self._check(ids)
        x = self._hidden(ids)
        if last_only:
            x = x[:, -1:]
        p = self.rank.executor.compute.view("head")  # tied: the embedding's weight
        z = to_host(head.head_logits(x, p, self.rank.ctx)).astype(np.float32, copy=False)
        return z[:, -1] if last_only else z

    def loss(self, inputs, targets) -> float:
        """Mean token cross-entropy of `targets` (B, T) given `inputs` (B, T)."""
        inputs, targets = self._check(inputs), self._check(targets)
        compute, ctx = self.rank.executor.compute, self.rank.ctx
        loss, _ = head.head_forward(self._hidden(inputs), to_device(ctx.xp, targets),
                                      compute.view("head"), ctx)
        return float(loss)

    def generate(self, ids, max_new_tokens: int, *, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop: int | None = None
                 ) -> list[int]:
        """`ids` (a list of token ids) followed by up to `max_new_tokens` new ones: greedy when
        `temperature` is 0, else sampled (top-k, then top-p); stops after `stop` (an id)."""
        out = [int(i) for i in self._check(ids)[0]]
        rng = np.random.default_rng(seed)
        for _ in range(max_new_tokens):
            z = self.logits(out[-self.seq_len:], last_only=True)[0].astype(np.float64)  # (V,)
            nxt = int(np.argmax(z)) if temperature == 0 else sample(z, temperature, top_k,
                                                                    top_p, rng)
            out.append(nxt)
            if stop is not None and nxt == stop:
                break
        return out

    @property
    def tokenizer(self):
        """The run's tokenizer (`data.tokenizer`; byte-level when it names none), or the one
        `load(tokenizer=)` named."""
        if self._tok is None:
            d = self.cfg.data
            tok = (load_tokenizer(self._tok_spec) if self._tok_spec else
                   load_tokenizer(d.tokenizer or "byte", d.tokenizer_sha256, stored=True))
            if tok.vocab_size > self.vocab_size:
                raise DataError(f"tokenizer {tok.spec} has {tok.vocab_size} tokens, more than the "
                                f"model's vocabulary of {self.vocab_size}: give the model's own")
            self._tok = tok
        return self._tok

    def complete(self, prompt: str, max_new_tokens: int, **kw) -> str:
        """`prompt` and its continuation, as text, with the run's tokenizer (stopping at its
        end-of-text token); keyword arguments as `generate`'s."""
        tok = self.tokenizer
        ids = [int(i) for i in tok.encode(prompt)]
        if not ids:
            raise ValueError("the prompt is empty: give at least one character")
        kw.setdefault("stop", tok.eot_id)
        return tok.decode(self.generate(ids, max_new_tokens, **kw))

    def close(self) -> None:
        self.rank.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def sample(z: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0,
           rng: np.random.Generator | None = None) -> int:
    """One id from logits `z` (V,): softmax(z / temperature) restricted to the `top_k` largest
    (0: all), then to the fewest largest whose probability reaches `top_p`."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 to sample (0: greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")
    rng = rng or np.random.default_rng()
    order = np.argsort(-z, kind="stable")  # most likely first
    if top_k > 0:
        order = order[:top_k]
    p = np.exp((z[order] - z[order[0]]) / temperature)
    p /= p.sum()
    if top_p < 1:
        keep = int(np.searchsorted(np.cumsum(p), top_p)) + 1  # the fewest reaching top_p
        order, p = order[:keep], p[:keep] / p[:keep].sum()
    return int(order[rng.choice(len(order), p=p)])


def load(path: str, *, precision: str | None = None, threads: int = 0,
         seq_len: int | None = None, tokenizer: str | None = None, device: str = "cpu") -> Model:
    """A `Model` from a checkpoint (a `ckpt-NNNNNN` directory, or a checkpoints directory: its
    newest committed one) or a Hugging Face LLaMA directory (config.json + safetensors;
    `seq_len` defaults to its max_position_embeddings; its tokenizer.json, when present, is
    the model's tokenizer). `tokenizer`: a tokenizer to use instead of the run's; `device`:
    where it computes (`run.device`'s values; whatever device wrote the checkpoint)."""
    if os.path.isfile(os.path.join(path, CONFIG)):
        cfg = replace(Config(), init=replace(Config().init, from_hf=path))
        cfg = import_model_section(cfg, path)
        cfg = replace(cfg, model=replace(cfg.model, seq_len=seq_len or cfg.model.max_positions))
        if tokenizer is None and os.path.isfile(os.path.join(path, "tokenizer.json")):
            tokenizer = os.path.join(path, "tokenizer.json")
        return Model(cfg, lambda st: st.load_named(load_hf_params(path, cfg.model, st.names)),
                     source=path, precision=precision, threads=threads, tokenizer=tokenizer,
                     device=device)
    path = verified_checkpoint(committed_path(path))
    path, cfg, step = checkpoint_config(path)
    if seq_len:
        cfg = replace(cfg, model=replace(cfg.model, seq_len=seq_len))
    return Model(cfg, lambda st: load_stage(st, path, ("master",)), step=step, source=path,
                 precision=precision, threads=threads, tokenizer=tokenizer, device=device)


# --------------------------------------------------------------------------------------------
# Any layout: evaluation
# --------------------------------------------------------------------------------------------


def verified_checkpoint(path: str, comm=None) -> str:
    """`path` (a committed checkpoint) when `verify_checkpoint` finds it usable for its masters
    (every check a load makes, the shards' SHA-256 included; collective over `comm`), else a
    one-line ValueError naming every problem, the same on every rank."""
    problems = verify_checkpoint(path, comm=comm, buffers=("master",))
    if problems:
        raise ValueError(f"{path}: damaged checkpoint, not loaded: " + "; ".join(problems))
    return path


class InputError(ValueError):
    """Bad input found before any work, the same message on every rank (the CLIs exit 2)."""


def on_every_rank(comm, fn, *args):
    """`fn(*args)` on every rank; a bad-input error on any rank is an InputError on all of them
    (the first failing rank's message), so no rank starts work that another refused."""
    result, err = None, None
    try:
        result = fn(*args)
    except (ConfigError, ValueError, OSError, KeyError) as e:
        err = str(e) or type(e).__name__
    errs = comm.allgather(err) if comm is not None and comm.Get_size() > 1 else [err]
    first = next((e for e in errs if e), None)
    if first is not None:
        raise InputError(first)
    return result


def eval_layout(cfg: Config, world: int) -> Config:
    """`cfg` laid out on `world` ranks: its own layout when that is `world` ranks, else
    pp = 1 x dp = world with the same global batch (so the same eval windows)."""
    p = cfg.parallel
    if p.world_size == world:
        return cfg
    g = p.global_batch
    if g % (p.micro_batch * world):
        raise ConfigError(
            f"{world} ranks cannot split the global batch of {g} sequences (micro_batch "
            f"{p.micro_batch}): launch {p.world_size} ranks (the run's pp={p.pp} x dp={p.dp}), "
            "or set parallel.pp / parallel.dp / parallel.micro_batch"
        )
    return replace(cfg, parallel=replace(p, pp=1, dp=world, layers_per_stage=None,
                                         num_micro_batches=g // (p.micro_batch * world),
                                         replica_shares=None))


@dataclass(frozen=True)
class EvalResult:
    loss: float  # mean token cross-entropy over the batches
    batches: int
    tokens: int  # tokens scored
    path: str  # the token file

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf


def eval_dataset(cfg: Config, tokens: str | None = None) -> TokenDataset:
    """The held-out dataset an eval reads: `tokens`, else data.eval_tokens, else the val split
    beside data.tokens (DataError naming the fix when there is none)."""
    path = tokens or cfg.data.eval_tokens
    if not path and cfg.data.sources:
        raise DataError("the run blends data.sources, each with its own held-out file: give "
                        "--tokens FILE (e.g. the val split beside "
                        f"{cfg.data.sources[0].tokens}); training writes each source's eval "
                        "loss to eval.jsonl")
    if not path:
        train = cfg.data.tokens or default_tokens_path()  # "": the default corpus, as training
        if os.path.exists(train) or os.path.exists(f"{train}.bin"):  # a Megatron prefix too
            path = str(held_out_beside(*resolve_tokens(train, "data.tokens"), "--tokens"))
        else:
            path = str(val_path(train))
        if not os.path.exists(path):
            raise DataError(f"the run's held-out file {path} does not exist: give --tokens FILE")
    return TokenDataset.from_config(cfg, path, eval=True)


def eval_batch_count(ds: TokenDataset, batches: int | str | None, default: int) -> int:
    """How many batches: a number, `all` (every whole batch of the file), or the default."""
    if batches in (None, ""):
        return default
    if batches == "all":
        return max(1, ds.num_windows // ds.layout.global_batch)
    n = int(batches)
    if n < 1:
        raise ConfigError(f"--batches={n} must be >= 1 (or all)")
    return n


def evaluate(cfg: Config, comm, path: str, tokens: str | None = None,
             batches: int | str | None = None) -> EvalResult:
    """The loss of checkpoint `path` on a token file, in `cfg`'s layout (collective over
    `comm`; None or one rank for 1 x 1): the first `batches` sequential batches (default
    data.eval_batches), as the training run's eval reads them. `path` is trusted as it is:
    check it first with `verified_checkpoint` (as `ratrain eval` does)."""
    ds = eval_dataset(cfg, tokens)
    n = eval_batch_count(ds, batches, cfg.data.eval_batches)
    rank = build_rank(cfg, comm if comm is not None and comm.Get_size() > 1 else None,
                      load=lambda st: load_stage(st, path, ("master",)))
    try:
        replica = rank.topo.replica if rank.topo is not None else 0
        loss = rank.executor.eval_loss(eval_batches(ds, n, replica))
    finally:
        rank.close()
    return EvalResult(loss, n, n * ds.layout.global_batch * cfg.model.seq_len, str(ds.path))


__all__ = ["EvalResult", "InputError", "Model", "eval_batch_count", "eval_dataset", "eval_layout",
           "evaluate", "load", "on_every_rank", "sample", "verified_checkpoint"]
