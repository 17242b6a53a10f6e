"""Knowledge distillation as a task of the shared loop: a student (the run's ModelConfig) learns
from a trained teacher (``DistillConfig.teacher``, a run directory) on DataConfig's data.

Per loss-bearing token (the batch's ``weights``), with temperature T and teacher / student
distributions softened by it, p_T = softmax(logits / T)::

    loss = logit_weight * (alpha * T^2 * KL(p_teacher_T || p_student_T) + (1 - alpha) * CE)
         + feature_weight * mean over pairs (s, t) of D(h_student[s] @ W_st, h_teacher[t])

T^2 keeps the KL's gradients on the scale of the CE's as T grows (Hinton et al. 2015). h[i] is the
residual stream after layer i (``model.forward_hidden``), the teacher's RMS-normalised per token
(``rms_normalise``); W_st [d_student, d_teacher] is a trained projection per pair; D is the MSE
over the teacher's width or 1 - cosine similarity. The step logs
``kl``, ``ce`` and ``feature`` per token beside the loss.

- **The teacher** is read once: its config.gin gives its ModelConfig (any size: depth, width and
  heads differ from the student's), its newest good checkpoint its parameters, placed on the run's
  mesh with the teacher's own shardings (its logical names through the same rules table). The loss
  runs its forward inside the jitted step, under ``stop_gradient``; its parameters are constants of
  the step, not state (never checkpointed with the student, never differentiated). It must use the
  student's tokenizer and vocabulary.
- **Teacher logits online or from disk.** ``teacher_logits = "online"`` runs the teacher in every
  step. A directory keeps the teacher's ``top_k`` log-probs per token (ids int32, log-probs float32,
  at T = 1, so T and alpha may change without recomputing), one ``.npz`` per batch and process
  (``train/PPPP-NNNNNNN.npz``, ``eval/...``): a batch missing there is computed by the teacher once
  and written (atomically), so the first run fills the cache and later ones (other students, alpha,
  T) read it. ``cache.json`` holds a fingerprint of teacher checkpoint, data, batch shape and
  top_k; a cache made for anything else is refused with one line. The KL is then taken over the
  teacher's top-k, renormalised: exact when top_k covers the vocabulary, otherwise the usual sparse
  approximation (the tail the teacher gives least mass is dropped). The train stream's position in
  the cache is part of the data state, so a resumed run reads the same shards.
- **Feature distillation**: the projections are the task's own parameters (``step.TaskParams``):
  they sit beside the student's in the train state under ``step.TASK_PARAMS`` (trained,
  checkpointed and restored with it; the model's forward ignores them), and a warm start never
  carries them. The two-stage recipe is two runs: stage 1 with features (``logit_weight = 0`` for
  matching alone, or with the logit loss), stage 2 logit distillation with ``TrainConfig.init_from``
  = stage 1's run: the student's parameters carry over, the stage-1 projections are dropped.

The run ends by printing the student's and the teacher's cross-entropy on the held-out batches
(``heldout_ce``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from maxlm import config as config_lib
from maxlm import data, model, rules
from maxlm.config import Config, ConfigError, ModelConfig
from maxlm.model import cross_entropy
from maxlm.parallel import sharding
from maxlm.train import checkpoint, step
from maxlm.train.tasks import LM_BATCH, Task, open_lm_data

TOPK = ("batch", "length", None)
CACHED_BATCH = {**LM_BATCH, "teacher_ids": TOPK, "teacher_logp": TOPK}
PROJ = "feature_proj"  # the task's parameters: {PROJ: W [pairs, d_student, d_teacher]}


# ---- the loss terms, per token (pure functions of arrays; tests check them against numpy)


def _vocab(logits: jax.Array, vocab_size: int) -> jax.Array:
    """The real vocabulary's columns (padding dropped), in fp32."""
    return logits[..., :vocab_size].astype(jnp.float32)


def kl_full(teacher_logits: jax.Array, student_logits: jax.Array, temperature: float,
            vocab_size: int) -> jax.Array:
    """KL(p_teacher_T || p_student_T) per token [...], over the whole vocabulary."""
    log_q = jax.nn.log_softmax(_vocab(teacher_logits, vocab_size) / temperature, axis=-1)
    log_p = jax.nn.log_softmax(_vocab(student_logits, vocab_size) / temperature, axis=-1)
    return jnp.sum(jnp.exp(log_q) * (log_q - log_p), axis=-1)


def kl_topk(teacher_ids: jax.Array, teacher_logp: jax.Array, student_logits: jax.Array,
            temperature: float, vocab_size: int) -> jax.Array:
    """KL per token from the teacher's cached top-k log-probs (at T = 1): the teacher's tempered
    distribution restricted to those ids and renormalised, against the student's full tempered
    distribution at them. Equals ``kl_full`` when the k ids cover the vocabulary."""
    log_q = jax.nn.log_softmax(teacher_logp.astype(jnp.float32) / temperature, axis=-1)
    log_p = jax.nn.log_softmax(_vocab(student_logits, vocab_size) / temperature, axis=-1)
    log_p = jnp.take_along_axis(log_p, teacher_ids, axis=-1)
    return jnp.sum(jnp.exp(log_q) * (log_q - log_p), axis=-1)


def rms_normalise(x: jax.Array) -> jax.Array:
    """x / RMS(x) over the last axis, in fp32: the teacher's hidden states as the feature loss
    matches them (their scale grows with depth and training; normalised, the MSE starts near 1 at
    every layer and feature_weight means the same for any teacher)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6)


def feature_distance(projected: jax.Array, target: jax.Array, kind: str) -> jax.Array:
    """Per token [...]: the MSE over the last (teacher width) axis, or 1 - cosine similarity."""
    projected, target = projected.astype(jnp.float32), target.astype(jnp.float32)
    if kind == "mse":
        return jnp.mean(jnp.square(projected - target), axis=-1)
    dot = jnp.sum(projected * target, axis=-1)
    norms = jnp.linalg.norm(projected, axis=-1) * jnp.linalg.norm(target, axis=-1)
    return 1.0 - dot / jnp.maximum(norms, 1e-6)


# ---- the teacher


@dataclasses.dataclass
class Teacher:
    cfg: ModelConfig  # its own model (remat off: nothing of it is differentiated)
    params: Any  # on the run's mesh, with the teacher's shardings
    source: Path  # the checkpoint folder (or imported params) read
    identity: str  # what the cache fingerprint records of it


def _teacher_error(cfg: Config, msg: str) -> ConfigError:
    return ConfigError(f"{cfg.source}: DistillConfig.teacher = {cfg.distill.teacher!r}: {msg}")


def _teacher_step(cfg: Config, run_dir: Path, step_dir: Path | None, run_cfg: Config) -> tuple[Path, bool]:
    """(what to read, is it a train checkpoint?): ``step_dir``, else the newest good checkpoint,
    else the imported parameters config.gin names."""
    if step_dir is not None:
        problem = checkpoint.checkpoint_problem(step_dir)
        if problem:
            raise _teacher_error(cfg, f"checkpoint {step_dir} is {problem}")
        return step_dir, True
    ckpts = run_dir / "checkpoints"
    steps = sorted((int(p.name) for p in ckpts.iterdir() if p.name.isdigit()), reverse=True) if ckpts.is_dir() else []
    problems = []
    for s in steps:
        problem = checkpoint.checkpoint_problem(ckpts / str(s))
        if problem is None:
            return ckpts / str(s), True
        problems.append(f"{s}: {problem}")
    if problems:
        raise _teacher_error(cfg, f"no usable checkpoint in {ckpts} ({'; '.join(problems[:3])})")
    if run_cfg.train.init_params:
        return Path(run_cfg.train.init_params).expanduser().resolve(), False
    raise _teacher_error(cfg, f"{run_dir} holds no checkpoint (train the teacher first: python -m maxlm.train "
                              f"--config=... --run_dir={run_dir})")


def load_teacher(cfg: Config, mesh: jax.sharding.Mesh) -> Teacher:
    """The teacher DistillConfig names, checked against the student and placed on ``mesh``; every
    problem is one ConfigError line naming the file or field at fault."""
    path = Path(cfg.distill.teacher).expanduser().resolve()
    if not path.exists():
        raise _teacher_error(cfg, "does not exist (expected the run directory of a trained teacher, or "
                                  "RUN_DIR/checkpoints/STEP)")
    step_dir = path if path.name.isdigit() and path.parent.name == "checkpoints" else None
    run_dir = path.parent.parent if step_dir else path
    gin_path = run_dir / "config.gin"
    if not gin_path.is_file():
        raise _teacher_error(cfg, f"{gin_path} is missing (expected a maxlm run directory)")
    try:
        run_cfg = config_lib.load(str(gin_path))
    except ConfigError as err:
        raise _teacher_error(cfg, f"{gin_path}: {str(err).removeprefix('config.gin: ')}") from None
    t, s = dataclasses.replace(run_cfg.model, remat="none"), cfg.model
    if t.vocab_size != s.vocab_size:
        raise _teacher_error(cfg, f"the teacher's ModelConfig.vocab_size = {t.vocab_size} ({gin_path}) differs from "
                                  f"the student's {s.vocab_size}: teacher and student must share the vocabulary")
    try:
        tok_t, tok_s = (data.get_tokenizer(c.data.tokenizer).fingerprint for c in (run_cfg, cfg))
    except (OSError, ValueError) as err:
        raise _teacher_error(cfg, f"cannot load a tokenizer ({' '.join(str(err).split())[:200]})") from None
    if tok_t != tok_s:
        raise _teacher_error(cfg, f"the teacher's DataConfig.tokenizer = {run_cfg.data.tokenizer!r} ({tok_t}, "
                                  f"{gin_path}) is not the student's {cfg.data.tokenizer!r} ({tok_s}): teacher "
                                  "and student must share the tokenizer")
    for s_layer, t_layer in cfg.distill.feature_pairs():
        if t_layer > t.n_layers:
            raise ConfigError(f"{cfg.source}: DistillConfig.feature_layers = {cfg.distill.feature_layers!r} names "
                              f"teacher layer {t_layer}, but the teacher has ModelConfig.n_layers = {t.n_layers} "
                              f"({gin_path})")
    problem = rules.divisibility_problem(t.logical_sizes(), dict(mesh.shape))
    if problem:
        raise _teacher_error(cfg, f"the teacher does not fit this run's mesh {dict(mesh.shape)}: {problem} "
                                  f"(the teacher's {gin_path})")
    source, is_ckpt = _teacher_step(cfg, run_dir, step_dir, run_cfg)
    shardings = sharding.mesh_shardings(sharding.logical_specs(model.abstract_params(t, boxed=True)), mesh)
    try:
        if is_ckpt:
            params = checkpoint.restore_state_params(source, model.abstract_params(t), shardings)
        else:
            params = checkpoint.restore_params(source, model.abstract_params(t), shardings)
    except Exception as err:  # noqa: BLE001 - Orbax/tensorstore raise many types for damaged files
        raise _teacher_error(cfg, f"cannot read the parameters of {source} ({type(err).__name__}: "
                                  f"{' '.join(str(err).split())[:200]})") from None
    manifest = source / checkpoint.MANIFEST
    stamp = hashlib.sha256(manifest.read_bytes()).hexdigest()[:16] if manifest.is_file() else \
        f"mtime {max(p.stat().st_mtime for p in source.rglob('*'))}"
    identity = f"{source} ({stamp}); {json.dumps(dataclasses.asdict(t), sort_keys=True)}"
    return Teacher(t, params, source, identity)


# ---- the teacher-logit cache


def _host_rows(x: jax.Array, mesh: jax.sharding.Mesh, spec: PartitionSpec) -> np.ndarray:
    """This process's rows of a batch-sharded global array (all of it on one process)."""
    if jax.process_count() == 1:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.global_array_to_host_local_array(x, mesh, spec))


class TeacherCache:
    """The teacher's top-k log-probs per batch, on disk under a fingerprint (module docstring)."""

    def __init__(self, cfg: Config, teacher: Teacher, mesh: jax.sharding.Mesh):
        self.dir = Path(cfg.distill.teacher_logits).expanduser()
        self.mesh, self.k = mesh, min(cfg.distill.top_k, cfg.model.vocab_size)
        ignore = ("prefetch", "read_threads")  # how the data is read, not what
        self.info = {"teacher": teacher.identity, "top_k": self.k,
                     "data": {k: v for k, v in dataclasses.asdict(cfg.data).items() if k not in ignore},
                     "seq_len": cfg.train.seq_len, "global_batch": cfg.train.global_batch,
                     "processes": jax.process_count()}
        self.fingerprint = hashlib.sha256(json.dumps(self.info, sort_keys=True).encode()).hexdigest()[:16]
        self._check(cfg)
        vocab, k = cfg.model.vocab_size, self.k
        spec = sharding.logical_to_spec(TOPK)
        self.spec, batch_sh = spec, step.batch_shardings(LM_BATCH, mesh)

        def top_k(b):
            logits, _ = model.forward(teacher.cfg, teacher.params, b["inputs"], b["segment_ids"], b["positions"])
            logp, ids = jax.lax.top_k(jax.nn.log_softmax(_vocab(logits, vocab), axis=-1), k)
            return ids.astype(jnp.int32), logp
        out = NamedSharding(mesh, spec)
        self._top_k = jax.jit(top_k, in_shardings=(batch_sh,), out_shardings=(out, out))
        self.computed = self.read = 0

    def _check(self, cfg: Config) -> None:
        where = f"{cfg.source}: DistillConfig.teacher_logits = {cfg.distill.teacher_logits!r}"
        meta = self.dir / "cache.json"
        if meta.is_file():
            try:
                saved = json.loads(meta.read_text())
            except (OSError, ValueError) as err:
                raise ConfigError(f"{where}: {meta} is unreadable ({err}); delete the directory to rebuild "
                                  "it") from None
            if saved.get("fingerprint") != self.fingerprint:
                old, new = saved.get("info", {}), self.info
                diff = next((k for k in new if old.get(k) != new.get(k)), "fingerprint")
                raise ConfigError(f"{where} holds the teacher log-probs of another run ({diff} differs: "
                                  f"{str(old.get(diff))[:120]!r} there, {str(new.get(diff))[:120]!r} now); "
                                  "delete it or point DistillConfig.teacher_logits at a new directory")
            return
        if self.dir.exists() and any(self.dir.iterdir()):
            raise ConfigError(f"{where} exists and is not a teacher-logit cache (no cache.json); give an empty "
                              "or new directory")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            if jax.process_index() == 0:
                _write_atomic(meta, json.dumps({"fingerprint": self.fingerprint, "info": self.info}, indent=1).encode())
        except OSError as err:
            raise ConfigError(f"{where}: cannot write there ({err.strerror or err})") from None

    def path(self, split: str, index: int) -> Path:
        return self.dir / split / f"{jax.process_index():04d}-{index:07d}.npz"

    def get(self, split: str, index: int, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """This process's rows of the teacher's top-k for batch ``index`` of ``split``, read from the
        cache, or computed and written there."""
        path = self.path(split, index)
        want = batch["inputs"].shape + (self.k,)
        if path.is_file():
            try:
                with np.load(path) as f:
                    ids, logp = f["ids"], f["logp"]
                if ids.shape == want and logp.shape == want:
                    self.read += 1
                    return {"teacher_ids": ids, "teacher_logp": logp}
            except (OSError, ValueError, KeyError):
                pass  # damaged (a kill mid-write leaves only a temporary, but a disk can fail): recompute
        ids, logp = self._top_k(step.device_batch(batch, self.mesh, LM_BATCH))
        ids, logp = _host_rows(ids, self.mesh, self.spec), _host_rows(logp, self.mesh, self.spec)
        path.parent.mkdir(parents=True, exist_ok=True)
        buf = _npz(ids=ids, logp=logp)
        _write_atomic(path, buf)
        self.computed += 1
        return {"teacher_ids": ids, "teacher_logp": logp}


def _npz(**arrays: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _write_atomic(path: Path, blob: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(blob)
    os.replace(tmp, path)


class CachedBatches:
    """The training iterator with the teacher's cached top-k added to each batch; its position in
    the stream is part of the data state, so a resumed run reads the shards it would have."""

    def __init__(self, inner: Any, cache: TeacherCache):
        self.inner, self.cache, self.index = inner, cache, 0

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = next(self.inner)
        batch = {**batch, **self.cache.get("train", self.index, batch)}
        self.index += 1
        return batch

    def get_state(self) -> dict:
        return {"data": self.inner.get_state(), "teacher_batches": self.index}

    def set_state(self, state: dict) -> None:
        if not state:
            return self.inner.set_state(state)
        if not isinstance(state, dict) or "teacher_batches" not in state:
            raise ValueError("the data state holds no position in the teacher-logit cache (it was saved by "
                             "a run with DistillConfig.teacher_logits = 'online' or another task)")
        self.inner.set_state(state["data"])
        self.index = int(state["teacher_batches"])

    def close(self) -> None:
        self.inner.close()


# ---- the task


def heldout_ce(model_cfg: ModelConfig, params: Any, batches: list[dict[str, Any]], mesh: jax.sharding.Mesh,
               forward: Callable | None = None) -> float:
    """Mean next-token cross-entropy (nats per loss-bearing token) of a model on LM batches."""
    forward = forward or (lambda p, *a: model.forward(model_cfg, p, *a))

    @jax.jit
    def ce(params, b):
        logits, _ = forward(params, b["inputs"], b["segment_ids"], b["positions"])
        return cross_entropy(logits, b["targets"], b["weights"], model_cfg.vocab_size)
    total = weight = 0.0
    for b in batches:
        loss_sum, w = jax.device_get(ce(params, step.device_batch(b, mesh, LM_BATCH)))
        total, weight = total + float(loss_sum), weight + float(w)
    return total / max(weight, 1.0)


def projection_params(cfg: Config, teacher_width: int) -> step.TaskParams:
    """One [d_student, d_teacher] projection per feature pair, trained beside the student."""
    pairs, d_s = len(cfg.distill.feature_pairs()), cfg.model.d_model

    def init(rng):
        w = jax.random.normal(rng, (pairs, d_s, teacher_width), jnp.float32) / np.sqrt(d_s)
        return {PROJ: w.astype(cfg.model.param_dtype)}
    return step.TaskParams(init, {PROJ: PartitionSpec(None, "embed", None)})


def make_loss(cfg: Config, forward: Callable, teacher: Teacher, cached: bool) -> step.LossFn:
    """The distillation loss (module docstring) on an LM batch, with the teacher's cached top-k
    in it when ``cached``."""
    d, vocab, temp = cfg.distill, cfg.model.vocab_size, cfg.distill.temperature
    pairs = d.feature_pairs()
    s_idx = jnp.array([s - 1 for s, _ in pairs], jnp.int32)
    t_idx = jnp.array([t - 1 for _, t in pairs], jnp.int32)

    def loss_fn(params, batch, rng):
        student = step.model_part(params)
        args = (batch["inputs"], batch["segment_ids"], batch["positions"])
        if pairs:
            logits, hidden = model.forward_hidden(cfg.model, student, *args, dropout_rng=rng)
            t_logits, t_hidden = model.forward_hidden(teacher.cfg, teacher.params, *args)
        else:
            logits, _ = forward(student, *args, dropout_rng=rng)
            t_logits = None if cached else model.forward(teacher.cfg, teacher.params, *args)[0]
        w = batch["weights"]
        ce_sum, weight = cross_entropy(logits, batch["targets"], w, vocab, cfg.train.z_loss)
        if cached:
            kl = kl_topk(batch["teacher_ids"], batch["teacher_logp"], logits, temp, vocab)
        else:
            kl = kl_full(jax.lax.stop_gradient(t_logits), logits, temp, vocab)
        kl_sum = jnp.sum(kl * w)
        loss = d.logit_weight * (d.alpha * temp ** 2 * kl_sum + (1.0 - d.alpha) * ce_sum)
        aux = {"kl": kl_sum, "ce": ce_sum}
        if pairs:
            proj = params[step.TASK_PARAMS][PROJ]
            s_feat = jnp.einsum("pbtd,pde->pbte", hidden[s_idx].astype(jnp.float32), proj.astype(jnp.float32))
            t_feat = jax.lax.stop_gradient(rms_normalise(t_hidden[t_idx]))
            feat_sum = jnp.sum(jnp.mean(feature_distance(s_feat, t_feat, d.feature_loss), axis=0) * w)
            loss = loss + d.feature_weight * feat_sum
            aux["feature"] = feat_sum
        return loss, weight, aux
    return loss_fn


def distill_task(cfg: Config, forward: Callable, mesh: jax.sharding.Mesh | None = None) -> Task:
    """The Task; ``mesh`` defaults to the one the config's MeshConfig gives (as the loop's)."""
    mesh = mesh or sharding.make_mesh(cfg.mesh.shape(jax.device_count()))
    d = cfg.distill
    if d.feature_pairs() and mesh.shape["pipeline"] > 1:
        raise ConfigError(f"{cfg.source}: DistillConfig.feature_layers needs the student's hidden states, which "
                          f"the pipeline does not collect: use MeshConfig.pipeline = 1 (it resolves to "
                          f"{mesh.shape['pipeline']})")
    train_batches, eval_batches = open_lm_data(cfg)
    teacher = load_teacher(cfg, mesh)
    cached = d.teacher_logits != "online"
    say = print if jax.process_index() == 0 else (lambda *a, **k: None)
    say(f"distill: teacher {teacher.source} ({model.param_count(teacher.cfg) / 1e6:.2f}M parameters, "
        f"{teacher.cfg.n_layers} layers x {teacher.cfg.d_model}); logits "
        + (f"from the cache {d.teacher_logits} (top {min(d.top_k, cfg.model.vocab_size)})" if cached else "online")
        + (f"; features {d.feature_layers} ({d.feature_loss}, weight {d.feature_weight})" if d.feature_pairs() else ""),
        flush=True)
    batch_spec = LM_BATCH
    if cached:
        cache = TeacherCache(cfg, teacher, mesh)
        batch_spec = CACHED_BATCH
        plain_train, plain_eval = train_batches, eval_batches

        def train_batches():
            return CachedBatches(plain_train(), cache)

        def eval_batches():
            return [{**b, **cache.get("eval", i, b)} for i, b in enumerate(plain_eval())]
    teacher_ce: list[float] = []

    def report(params) -> str:
        held = [{k: b[k] for k in LM_BATCH} for b in eval_batches()]
        student = heldout_ce(cfg.model, step.model_part(params), held, mesh, forward=forward)
        if not teacher_ce:
            teacher_ce.append(heldout_ce(teacher.cfg, teacher.params, held, mesh))
        tokens = int(sum(float(b["weights"].sum()) for b in held))
        return (f"held-out cross-entropy over {tokens:,} tokens: student {student:.4f}, teacher "
                f"{teacher_ce[0]:.4f} nats/token")

    params = projection_params(cfg, teacher.cfg.d_model) if d.feature_pairs() else None
    return Task("distill", make_loss(cfg, forward, teacher, cached), batch_spec, train_batches, eval_batches,
                sample=report, params=params)
