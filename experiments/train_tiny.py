"""Trains a small DeepSeek-V4-architecture model on the Python standard library's source, byte by byte.

    python -m experiments.train_tiny --out=experiments/checkpoints/tiny_stdlib

The model is `config.tiny_sparse` (4 layers: window, CSA, HCA, CSA; layer 0 hash-routed, the rest top-k routed),
so every Pallas fast path runs on it and the qualification's KL is measured on a model that predicts something.
Tokens are bytes (vocab 256, id = byte value). The corpus is every *.py file of the running interpreter's stdlib
(site-packages excluded), sorted; a file is held out for validation when the sha256 of its relative path says so,
so the split does not move when files are added or removed.

What gets no gradient, and how it is trained instead (docs/trained_checkpoint.md):
  * the lightning indexer of the CSA layers picks rows with top-k, so the LM loss never reaches it. It is trained
    as V4 trains it: by distillation (KL) towards the main attention's dense scores, i.e. the probability mass the
    layer's heads put on every visible compressed row when all of them are keys, summed over heads and normalised.
    The indexer's input is detached, so this loss trains the indexer only and the LM loss everything else.
  * the top-k routers' bias only ranks experts; it follows V4's auxiliary-loss-free balancing: after each step it
    moves by `bias_rate` towards the experts that got fewer tokens than average.
  * the hash layer's token -> experts table stays the random one drawn at init.

Writes into --out: config.json + model.safetensors (official names; with --official_formats dense projections FP8
E4M3 and routed experts FP4 E2M1 with UE8M0 scales), tokenizer.json (byte-level), training.json (config, corpus,
hyperparameters, loss curve, wall time) and prompt.txt (an ASCII excerpt of a validation file).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from flax import nnx

from ds4jax import config as config_lib
from ds4jax import model as model_lib
from ds4jax import rope
from ds4jax.checkpoint import mapping
from ds4jax.layers import rms_normalize
from experiments import run_record
from kernels_pallas.mla.reference import apply_rope, visible_rows, window_bias
from kernels_pallas.precision import einsum

F32 = jnp.float32
SEQ = 128  # bytes a model sees: max_position_embeddings of tiny_sparse
VAL_PERCENT = 5  # share of files held out
EXCLUDED_DIRS = ("site-packages", "dist-packages", "__pycache__")


# ---- corpus ----

def stdlib_files(root: str | None = None) -> list[str]:
  """Relative paths of the stdlib's *.py files, sorted (bytewise, so the order does not depend on the locale)."""
  root = root or sysconfig.get_paths()["stdlib"]
  out = []
  for d, dirs, files in os.walk(root):
    dirs[:] = [x for x in dirs if x not in EXCLUDED_DIRS]
    out += [os.path.relpath(os.path.join(d, f), root) for f in files if f.endswith(".py")]
  return sorted(out, key=lambda p: p.encode())


def is_validation(relpath: str) -> bool:
  """A fixed function of the path alone (not of the file list), so the split is stable across Python versions."""
  return int.from_bytes(hashlib.sha256(relpath.encode()).digest()[:4], "big") % 100 < VAL_PERCENT


@dataclasses.dataclass(frozen=True)
class Corpus:
  train: np.ndarray  # uint8, the training files concatenated (each followed by a NUL byte, a document separator)
  val: np.ndarray  # uint8, the validation files likewise
  val_files: tuple[str, ...]
  root: str
  description: dict


def load_corpus(root: str | None = None) -> Corpus:
  root = root or sysconfig.get_paths()["stdlib"]
  files = stdlib_files(root)
  parts = {False: [], True: []}
  for rel in files:
    with open(os.path.join(root, rel), "rb") as f:
      parts[is_validation(rel)].append(f.read() + b"\0")
  train, val = (np.frombuffer(b"".join(parts[v]), np.uint8) for v in (False, True))
  val_files = tuple(r for r in files if is_validation(r))
  listing = hashlib.sha256("\n".join(files).encode()).hexdigest()
  desc = dict(source="*.py of sysconfig.get_paths()['stdlib'] (site-packages excluded), sorted; each file + NUL",
              python=platform.python_version(), implementation=sys.implementation.name, root=root,
              files=len(files), train_files=len(files) - len(val_files), val_files=len(val_files),
              train_bytes=int(train.size), val_bytes=int(val.size), file_list_sha256=listing,
              validation_rule=f"sha256(relative path)[:4] as big-endian int % 100 < {VAL_PERCENT}")
  return Corpus(train, val, val_files, root, desc)


def sample_windows(data: np.ndarray, rng: np.random.Generator, batch: int, length: int = SEQ) -> np.ndarray:
  """[batch, length + 1] int32 windows at uniform offsets: inputs are [:, :-1], next-byte targets [:, 1:]."""
  starts = rng.integers(0, data.size - length - 1, batch)
  return data[starts[:, None] + np.arange(length + 1)].astype(np.int32)


def prompt_excerpt(corpus: Corpus, min_bytes: int = 512, max_bytes: int = 768) -> str:
  """An ASCII excerpt of a validation file, from a line start a third of the way in, cut at a line end."""
  for rel in corpus.val_files:
    with open(os.path.join(corpus.root, rel), "rb") as f:
      text = f.read()
    start = text.find(b"\n", len(text) // 3) + 1
    chunk = text[start:start + max_bytes]
    chunk = chunk[:chunk.rfind(b"\n") + 1]
    if start > 0 and len(chunk) >= min_bytes and chunk.isascii():
      return chunk.decode()
  raise ValueError("no validation file has an ASCII excerpt long enough")


# ---- tokenizer ----

def byte_symbols() -> list[str]:
  """The printable stand-in of each byte that byte-level BPE tokenizers use: printable Latin-1 bytes stand for
  themselves, the others for code points 256, 257, ... in byte order."""
  keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
  out, extra = [], 0
  for b in range(256):
    if b in keep:
      out.append(chr(b))
    else:
      out.append(chr(256 + extra))
      extra += 1
  return out


def tokenizer_json() -> dict:
  """A `tokenizers` tokenizer.json whose ids are the UTF-8 bytes: ByteLevel pre-tokenizer (no regex split, no
  prefix space), a BPE with the 256 byte symbols and no merges, the ByteLevel decoder, no special tokens."""
  return {
      "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
      "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
      "post_processor": None,
      "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
      "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                "vocab": {s: i for i, s in enumerate(byte_symbols())}, "merges": []},
  }


# ---- model and losses ----

def model_config(**overrides) -> config_lib.DeepseekV4Config:
  return config_lib.tiny_sparse(**({"name": "tiny_stdlib"} | overrides))


def trainable(path, node) -> bool:
  """Every parameter but the routers' bias (balanced, not learned)."""
  return isinstance(node, nnx.Param) and path[-1] != "bias"


def router_bias(path, node) -> bool:
  return isinstance(node, nnx.Param) and path[-1] == "bias"


def indexer_distillation(attn, x: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
  """(KL(dense attention's row distribution || indexer's softmax), recall) of one CSA layer on x [S, D].

  The target is what the layer's heads would give each visible compressed row if all of them were keys (window,
  every visible row and the sink in one softmax, as on an HCA layer), summed over heads and normalised over rows.
  Recall: the target mass on the indexer's top-k rows over the most a top-k can hold (1 = it picks the best k).
  Queries that see no row yet are left out of both means.
  """
  cfg = attn.cfg
  S, H, d = x.shape[0], cfg.num_heads, cfg.head_dim
  x = jax.lax.stop_gradient(x)  # the indexer's input is detached: this loss trains the indexer only
  pos = jnp.arange(S, dtype=jnp.int32)
  freqs = rope.layer_inv_freq(cfg, attn.kind)
  qr = jax.lax.stop_gradient(attn.q_norm(attn.wq_a(x)))
  q = apply_rope(rms_normalize(attn.wq_b(qr).reshape(S, H, d), cfg.rms_norm_eps), pos, freqs)
  kv = apply_rope(attn.kv_norm(attn.wkv(x)), pos, freqs)
  rows = attn.compressor(x, freqs)  # [R, d], R = S // ratio
  visible = visible_rows(pos, rows.shape[0], attn.compressor.ratio)  # [S, R]
  scale = d ** -0.5
  s_win = einsum("thd,jd->thj", q, kv) * scale + window_bias(pos, pos, cfg.sliding_window)[:, None, :]
  s_rows = jnp.where(visible[:, None, :], einsum("thd,rd->thr", q, rows) * scale, -jnp.inf)
  sink = jnp.broadcast_to(attn.attn_sink[...][None, :, None], (S, H, 1))
  lse = jax.nn.logsumexp(jnp.concatenate([s_win, s_rows, sink], axis=-1), axis=-1, keepdims=True)
  mass = jnp.sum(jnp.exp(s_rows - lse), axis=1)  # [S, R]
  target = jax.lax.stop_gradient(mass / jnp.maximum(jnp.sum(mass, axis=-1, keepdims=True), 1e-30))
  scores = attn.indexer.scores(x, qr, pos, freqs)  # [S, R], -inf where not visible
  logq = jax.nn.log_softmax(jnp.where(visible, scores, -1e30), axis=-1)
  kl = jnp.sum(jnp.where(visible, jax.scipy.special.xlogy(target, target) - target * logq, 0.0), axis=-1)
  has = jnp.any(visible, axis=-1).astype(F32)
  k = min(cfg.index_topk, rows.shape[0])
  picked = jnp.take_along_axis(target, jax.lax.top_k(jnp.where(visible, scores, -1e30), k)[1], axis=-1)
  best = jax.lax.top_k(target, k)[0]
  recall = jnp.sum(picked, -1) / jnp.maximum(jnp.sum(best, -1), 1e-30)
  n = jnp.maximum(jnp.sum(has), 1.0)
  return jnp.sum(kl * has) / n, jnp.sum(recall * has) / n


def sequence_terms(m: model_lib.DeepseekV4, window: jnp.ndarray) -> dict:
  """One window [S + 1] through the exact path: mean next-byte loss (nats/byte), the indexers' mean KL and recall,
  and the tokens each top-k layer routed to each expert ([n_topk_layers, E])."""
  cfg = m.cfg
  tokens, targets = window[:-1], window[1:]
  S = tokens.shape[0]
  X = m.embed_streams(tokens)
  kls, recalls, loads = [], [], []
  for layer, block in enumerate(m.layers):
    if block.attn.indexer is not None:
      h, _, _ = block.hc_attn(X)  # what band() computes first: the attention input
      kl, recall = indexer_distillation(block.attn, block.attn_norm(h))
      kls.append(kl)
      recalls.append(recall)
    X, _, decisions = block.band(X, tokens, 0, block.attn.empty_cache(S, S))
    if cfg.routing[layer] is config_lib.Routing.TOPK:
      loads.append(jnp.zeros((cfg.n_routed_experts,), F32).at[decisions.route_ids.reshape(-1)].add(1.0))
  logits = m.logits(X)
  lm = jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, targets[:, None], -1)[:, 0])
  zero = jnp.zeros((), F32)
  return dict(lm=lm, distill=jnp.mean(jnp.stack(kls)) if kls else zero,
              recall=jnp.mean(jnp.stack(recalls)) if recalls else zero,
              loads=jnp.stack(loads) if loads else jnp.zeros((0, cfg.n_routed_experts), F32))


@dataclasses.dataclass(frozen=True)
class Hyper:
  steps: int = 1000
  batch: int = 8
  lr: float = 6e-3
  min_lr_fraction: float = 0.1  # cosine decay to this fraction of lr
  warmup: int = 100
  weight_decay: float = 0.1  # on matrices only
  b1: float = 0.9
  b2: float = 0.95
  clip: float = 1.0  # global gradient norm
  distill_weight: float = 1.0  # the indexer loss reaches only the indexer, whose steps Adam normalises anyway
  bias_rate: float = 1e-3  # auxiliary-loss-free balancing step of the routers' bias
  seed: int = 0


def optimizer(h: Hyper) -> optax.GradientTransformation:
  schedule = optax.warmup_cosine_decay_schedule(0.0, h.lr, h.warmup, max(h.steps, h.warmup + 1),
                                                h.lr * h.min_lr_fraction)
  decay_matrices = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  # optax.adamw with clipping first, spelled out so that clipping and Adam run on one flat vector: the same
  # arithmetic in a few ops instead of a few per weight (its compile time halves).
  return optax.chain(optax.flatten(optax.chain(optax.clip_by_global_norm(h.clip), optax.scale_by_adam(h.b1, h.b2))),
                     optax.add_decayed_weights(h.weight_decay, decay_matrices),
                     optax.scale_by_learning_rate(schedule))


@dataclasses.dataclass
class TrainState:
  graphdef: nnx.GraphDef
  params: nnx.State  # trained by gradient
  bias: nnx.State  # routers' bias, balanced
  rest: nnx.State  # buffers (hash tables)
  opt: optax.OptState
  step: int = 0

  def model(self) -> model_lib.DeepseekV4:
    return nnx.merge(self.graphdef, self.params, self.bias, self.rest)


def init_state(cfg: config_lib.DeepseekV4Config, h: Hyper) -> TrainState:
  m = model_lib.init_random(cfg, seed=h.seed, dtype=F32)
  graphdef, params, bias, rest = nnx.split(m, trainable, router_bias, ...)
  return TrainState(graphdef, params, bias, rest, optimizer(h).init(params))


def _batch_terms(graphdef, params, bias, rest, batch) -> dict:
  m = nnx.merge(graphdef, params, bias, rest)
  terms = jax.vmap(lambda w: sequence_terms(m, w))(batch)
  return dict(lm=jnp.mean(terms["lm"]), distill=jnp.mean(terms["distill"]), recall=jnp.mean(terms["recall"]),
              loads=jnp.sum(terms["loads"], axis=0))


def make_train_step(graphdef: nnx.GraphDef, h: Hyper, compiler_options: dict | None = None):
  """A jitted (params, bias, rest, opt, batch) -> (params, bias, opt, metrics) step. `compiler_options` go to
  XLA (the tests ask for less optimisation: the step then compiles in half the time)."""
  tx = optimizer(h)

  def loss(params, bias, rest, batch):
    t = _batch_terms(graphdef, params, bias, rest, batch)
    return t["lm"] + h.distill_weight * t["distill"], t

  @functools.partial(jax.jit, compiler_options=compiler_options)
  def step(params, bias, rest, opt, batch):
    (_, t), grads = jax.value_and_grad(loss, has_aux=True)(params, bias, rest, batch)
    updates, opt = tx.update(grads, opt, params)
    params = optax.apply_updates(params, updates)
    # Balancing: each top-k layer's bias rises for experts below the mean load and falls for those above.
    loads = t["loads"]
    nudge = h.bias_rate * jnp.sign(jnp.mean(loads, axis=-1, keepdims=True) - loads)
    leaves, treedef = jax.tree.flatten(bias)  # layer order: the State's keys sort by layer index
    bias = jax.tree.unflatten(treedef, [b + nudge[i] for i, b in enumerate(leaves)])
    imbalance = jnp.max(loads, axis=-1) / jnp.maximum(jnp.mean(loads, axis=-1), 1.0)
    return params, bias, opt, dict(lm=t["lm"], distill=t["distill"], recall=t["recall"],
                                   max_load_over_mean=jnp.max(imbalance) if imbalance.size else 0.0)

  return step


def train_steps(state: TrainState, step_fn, batches) -> list[dict]:
  """Runs step_fn over `batches` (each [B, S + 1] int32), updating `state` in place; per-step metrics."""
  out = []
  for batch in batches:
    state.params, state.bias, state.opt, metrics = step_fn(state.params, state.bias, state.rest, state.opt,
                                                           jnp.asarray(batch))
    state.step += 1
    out.append({k: float(v) for k, v in metrics.items()})
  return out


@jax.jit
def _eval_terms(graphdef, params, bias, rest, batch):
  t = _batch_terms(graphdef, params, bias, rest, batch)
  return t["lm"], t["distill"], t["recall"]


EVAL_CHUNK = 16  # windows per evaluation program


def evaluate(m: model_lib.DeepseekV4, windows: np.ndarray, chunk: int = EVAL_CHUNK) -> dict:
  """Mean next-byte loss (nats/byte), indexer KL and recall over `windows` [N, S + 1], in chunks of `chunk`."""
  graphdef, params, bias, rest = nnx.split(m, trainable, router_bias, ...)
  sums = np.zeros(3)
  n = windows.shape[0] // chunk * chunk
  for i in range(0, n, chunk):
    terms = _eval_terms(graphdef, params, bias, rest, jnp.asarray(windows[i:i + chunk]))
    sums += np.asarray([float(v) for v in terms])
  lm, distill, recall = sums / (n // chunk)
  return dict(loss=lm, distill=distill, recall=recall)


# Evaluation programs run once per model, so they skip XLA's slower optimisation passes (half the compile time).
LOW_OPT = dict(xla_backend_optimization_level=0)


@functools.partial(jax.jit, compiler_options=LOW_OPT)
def _logits(graphdef, state, ids):
  return nnx.merge(graphdef, state)(ids)


def prompt_logits(m: model_lib.DeepseekV4, data: bytes) -> tuple[np.ndarray, np.ndarray]:
  """(logits [S, vocab] of the exact path, the ids [S + 1]) for the first max_position_embeddings + 1 bytes."""
  ids = np.frombuffer(data, np.uint8)[: m.cfg.max_position_embeddings + 1].astype(np.int32)
  return np.asarray(_logits(*nnx.split(m), jnp.asarray(model_lib.check_tokens(ids[:-1], m.cfg)))), ids


def byte_loss(m: model_lib.DeepseekV4, data: bytes) -> float:
  """Mean next-byte loss (nats/byte) of the first max_position_embeddings + 1 bytes of `data`."""
  logits, ids = prompt_logits(m, data)
  logits = logits.astype(np.float64)
  logz = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
  return float(np.mean(logz - logits[np.arange(ids.size - 1), ids[1:]]))


def reload_check(m: model_lib.DeepseekV4, stored: str, data: bytes) -> dict:
  """How the stored checkpoint's logits on `data` compare with the trained model's, and how a plain f32 copy's do
  (that one must match exactly: the layout loses nothing, only FP8/FP4 storage rounds)."""
  with tempfile.TemporaryDirectory() as tmp:
    mapping.save_checkpoint(m, tmp, official_formats=False)
    plain = mapping.load_checkpoint(tmp, dtype=F32, log=None)
  ref = prompt_logits(m, data)[0]
  f32 = prompt_logits(plain, data)[0]
  got = prompt_logits(mapping.load_checkpoint(stored, dtype=F32, log=None), data)[0]
  logp = lambda z: np.asarray(jax.nn.log_softmax(jnp.asarray(z), -1), np.float64)
  kl = np.sum(np.exp(logp(ref)) * (logp(ref) - logp(got)), -1)
  return dict(f32_copy_max_abs_logit_diff=float(np.max(np.abs(f32 - ref))),
              stored_max_abs_logit_diff=float(np.max(np.abs(got - ref))),
              stored_mean_abs_logit_diff=float(np.mean(np.abs(got - ref))),
              stored_mean_kl=float(np.mean(kl)), tokens=int(ref.shape[0]))


# ---- the run ----

def check_settings(h: Hyper, eval_every: int, val_windows: int) -> None:
  """ValueError naming the first setting out of range (val_windows: evaluate() takes whole chunks)."""
  for name, value, least in (("steps", h.steps, 1), ("batch", h.batch, 1), ("warmup", h.warmup, 0),
                             ("eval_every", eval_every, 1), ("val_windows", val_windows, EVAL_CHUNK)):
    if value < least:
      raise ValueError(f"--{name} must be >= {least}, got {value}")


def run(out: str, h: Hyper, *, eval_every: int, val_windows: int, official_formats: bool,
        log=print) -> dict:
  check_settings(h, eval_every, val_windows)  # before any work
  t0 = time.time()
  corpus = load_corpus()
  d = corpus.description
  log(f"corpus: Python {d['python']} stdlib, {d['files']} files ({d['val_files']} held out), "
      f"{d['train_bytes'] / 1e6:.1f} MB train, {d['val_bytes'] / 1e6:.2f} MB val")
  cfg = model_config()
  counts = cfg.param_counts()
  log(f"model: {cfg.name}, {counts['total']:,} parameters ({counts['active_per_token']:,} active per token)")
  rng = np.random.default_rng(h.seed)
  val = sample_windows(corpus.val, np.random.default_rng(h.seed + 1), val_windows)
  train_probe = sample_windows(corpus.train, np.random.default_rng(h.seed + 2), 64)  # the step-0 train loss
  state = init_state(cfg, h)
  step_fn = make_train_step(state.graphdef, h)
  curve = dict(step=[], train_loss=[], val_loss=[], indexer_kl=[], indexer_recall=[], max_load_over_mean=[],
               elapsed_s=[])
  recent = []

  def record(step):
    ev = evaluate(state.model(), val)
    # Train loss: the mean of the batches since the last report (at step 0, of fixed training windows).
    train = float(np.mean([r["lm"] for r in recent])) if recent else evaluate(state.model(), train_probe)["loss"]
    load = float(np.mean([r["max_load_over_mean"] for r in recent])) if recent else None
    row = dict(step=step, train_loss=train, val_loss=ev["loss"], indexer_kl=ev["distill"],
               indexer_recall=ev["recall"], max_load_over_mean=load, elapsed_s=time.time() - t0)
    for k, v in row.items():
      curve[k].append(round(v, 4) if isinstance(v, float) else v)
    log(f"step {step:5d}  train {train:.3f}  val {ev['loss']:.3f} nats/byte  indexer KL {ev['distill']:.3f} "
        f"recall {ev['recall']:.3f}  " + (f"max/mean expert load {load:.2f}  " if load else "")
        + f"{time.time() - t0:.0f}s")
    recent.clear()

  record(0)
  t_train = time.time()
  for step in range(1, h.steps + 1):
    recent += train_steps(state, step_fn, [sample_windows(corpus.train, rng, h.batch)])
    if step % eval_every == 0 or step == h.steps:
      record(step)
  train_s = time.time() - t_train

  m = state.model()
  os.makedirs(out, exist_ok=True)
  mapping.save_checkpoint(m, out, official_formats=official_formats)
  with open(os.path.join(out, "tokenizer.json"), "w") as f:
    json.dump(tokenizer_json(), f, ensure_ascii=False)
  prompt = prompt_excerpt(corpus)
  with open(os.path.join(out, "prompt.txt"), "w") as f:
    f.write(prompt)
  # The stored checkpoint, read back as the qualification reads it: its loss is the one that counts.
  reloaded = mapping.load_checkpoint(out, dtype=F32, log=None)
  ev_saved = evaluate(reloaded, val)
  reload = reload_check(m, out, prompt.encode())
  log(f"saved {out}: val {ev_saved['loss']:.4f} nats/byte as stored (trained f32: {curve['val_loss'][-1]:.4f}); "
      f"on the prompt, max |logit difference| {reload['stored_max_abs_logit_diff']:.3g} as stored, "
      f"{reload['f32_copy_max_abs_logit_diff']:.3g} for an f32 copy; KL {reload['stored_mean_kl']:.2e}")
  files = ("config.json", "model.safetensors", "tokenizer.json", "prompt.txt")
  record_ = dict(
      run_record.environment(), model=dict(config=cfg.to_dict(), parameters=counts,
                                           official_formats=official_formats),
      corpus=d, hyperparameters=dataclasses.asdict(h) | dict(seq_len=SEQ, eval_every=eval_every,
                                                            val_windows=val_windows),
      seed=h.seed, loss_unit="nats/byte", uniform_loss=math.log(256), curve=curve,
      final=dict(train_loss=curve["train_loss"][-1], val_loss=curve["val_loss"][-1],
                 val_loss_stored=ev_saved["loss"], indexer_recall=curve["indexer_recall"][-1],
                 prompt_loss_trained=byte_loss(m, prompt.encode()),
                 prompt_loss_stored=byte_loss(reloaded, prompt.encode())),
      reload=reload,
      wall_time_s=dict(total=time.time() - t0, training=train_s),
      bytes_on_disk={f: os.path.getsize(os.path.join(out, f)) for f in files})
  run_record.write_json(os.path.join(out, "training.json"), record_)
  return record_


def define_flags(fv=flags.FLAGS):
  d = Hyper()
  run_record.define_out_flag(default="experiments/checkpoints/tiny_stdlib", directory=True, flag_values=fv,
                            help_text="Output directory (the default is the committed checkpoint, rewritten).")
  flags.DEFINE_integer("steps", d.steps, "Optimizer steps.", flag_values=fv)
  flags.DEFINE_integer("batch", d.batch, "Windows of 128 bytes per step.", flag_values=fv)
  flags.DEFINE_float("lr", d.lr, "Peak AdamW learning rate (warmup, then cosine decay).", flag_values=fv)
  flags.DEFINE_integer("warmup", d.warmup, "Linear warmup steps.", flag_values=fv)
  flags.DEFINE_integer("seed", d.seed, "Seed of the weights and of the batches.", flag_values=fv)
  flags.DEFINE_integer("eval_every", 100, "Steps between validation evaluations.", flag_values=fv)
  flags.DEFINE_integer("val_windows", 256, "Validation windows (fixed, seeded).", flag_values=fv)
  flags.DEFINE_bool("official_formats", True, "Store FP8/FP4 as the official checkpoint does.", flag_values=fv)


def main(argv):
  del argv
  fv = flags.FLAGS
  h = Hyper(steps=fv.steps, batch=fv.batch, lr=fv.lr, warmup=fv.warmup, seed=fv.seed)
  try:
    check_settings(h, fv.eval_every, fv.val_windows)
  except ValueError as e:
    sys.exit(f"train_tiny: {e}")
  run(fv.out, h, eval_every=fv.eval_every, val_windows=fv.val_windows, official_formats=fv.official_formats)


if __name__ == "__main__":
  define_flags()
  app.run(main)
