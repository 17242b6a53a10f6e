"""Small models, batches and training runs shared by the tests."""

import functools

import jax
import numpy as np

from maxlm import config, model
from maxlm.parallel import sharding
from maxlm.train import optim, step, tasks


def small_config(num_devices=8, model=None, **sections):
    """A model that compiles in seconds; grouped-query attention unless overridden."""
    base = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=128, vocab_multiple=8,
                max_seq_len=64, dtype="float32")
    base.update(model or {})
    train = dict(global_batch=8, seq_len=32, steps=10, sample_tokens=0)  # max_seq_len 64 leaves no room
    train.update(sections.pop("train", {}))
    opt = dict(warmup_steps=2, learning_rate=1e-2)
    opt.update(sections.pop("optim", {}))
    return config.build(num_devices=num_devices, model=base, train=train, optim=opt, **sections)


def lm_loss(cfg, params, batch, mesh=None):
    """(summed cross-entropy, summed weight) of pre-training's task; on `mesh` when given (the
    layer stack is then chosen from it, e.g. pipelined)."""
    forward = step.model_forward(cfg, mesh) if mesh is not None else functools.partial(model.forward, cfg.model)
    return tasks.lm_loss(forward, cfg.model.vocab_size, cfg.train.z_loss)(params, batch, None)[:2]


def random_batch(rng, batch=8, seq_len=32, vocab=259):
    """Two documents per row, with the loss masked at each document's last token."""
    tokens = rng.integers(0, vocab, (batch, seq_len + 1)).astype(np.int32)
    half = seq_len // 2
    segments = np.where(np.arange(seq_len) < half, 1, 2)[None].repeat(batch, 0).astype(np.int32)
    positions = np.concatenate([np.arange(half), np.arange(seq_len - half)])[None].repeat(batch, 0)
    weights = np.ones((batch, seq_len), np.float32)
    weights[:, half - 1] = weights[:, -1] = 0
    return dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], segment_ids=segments,
                positions=positions.astype(np.int32), weights=weights)


def train_losses(cfg, devices, steps=5, seed=0, batches=None):
    """Losses of `steps` real train steps on a mesh over `devices`, plus the final state.

    Without `batches` every step sees one fixed random batch, which the model can memorise."""
    mesh = sharding.make_mesh(cfg.mesh.shape(len(devices)), devices)
    optimizer = optim.make_optimizer(cfg.optim, cfg.train.steps)
    shardings = step.state_shardings(cfg, mesh, optimizer)
    fixed = random_batch(np.random.default_rng(seed), cfg.train.global_batch, cfg.train.seq_len)
    losses = []
    with jax.set_mesh(mesh):
        state = step.init_state(cfg, optimizer, shardings)
        train_step, _ = tasks.lm_steps(cfg, mesh, optimizer, shardings)
        for i in range(steps):
            batch = batches[i] if batches else fixed
            state, metrics = train_step(state, step.device_batch(batch, mesh, tasks.LM_BATCH))
            losses.append(float(metrics["loss"]))
    return np.array(losses), state



# Halves XLA:CPU compile times by skipping LLVM's optimisations; the HLO (partitioning,
# collectives) is unchanged. For tests that compare numbers, not speed.
QUICK_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def loss_and_grads(cfg, devices, params=None, seed=0, compiler_options=None):
    """Mean loss and its gradients (numpy) on one fixed batch, on a mesh over `devices`, plus the
    compiled HLO text of the loss-and-gradient computation. `params` (host arrays, e.g. another
    run's) are placed by the config's shardings; without them the model is initialised here.
    `compiler_options` go to XLA (e.g. QUICK_COMPILE)."""

    mesh = sharding.make_mesh(cfg.mesh.shape(len(devices)), devices)
    fixed = random_batch(np.random.default_rng(seed), cfg.train.global_batch, cfg.train.seq_len)
    param_sh = sharding.mesh_shardings(step.param_names(cfg), mesh)
    batch_sh = step.batch_shardings(tasks.LM_BATCH, mesh)

    def mean_loss(params, batch):
        loss_sum, weight = lm_loss(cfg, params, batch, mesh)
        return loss_sum / weight

    with jax.set_mesh(mesh):
        if params is None:
            params = jax.jit(lambda: model.init_params(cfg.model, jax.random.PRNGKey(cfg.train.seed)),
                             out_shardings=param_sh)()
        else:
            params = jax.device_put(params, param_sh)
        batch = step.device_batch(fixed, mesh, tasks.LM_BATCH)
        compiled = jax.jit(jax.value_and_grad(mean_loss), in_shardings=(param_sh, batch_sh)).lower(
            params, batch).compile(compiler_options)
        loss, grads = compiled(params, batch)
    return float(loss), jax.tree.map(np.asarray, grads), compiled.as_text()


def straight_and_resumed(make_cfg, tmp_path, *, steps, stop_at):
    """(summary of a post-training run of ``steps`` steps, summary of the same run stopped at
    ``stop_at`` and then resumed to ``steps``); ``make_cfg(run_dir, steps)`` gives each run's config."""
    from maxlm.posttrain import build_task
    from maxlm.train import pretrain

    straight = pretrain.train(make_cfg(tmp_path / "straight", steps), build_task=build_task)
    pretrain.train(make_cfg(tmp_path / "resumed", stop_at), build_task=build_task)
    resumed = pretrain.train(make_cfg(tmp_path / "resumed", steps), build_task=build_task)
    assert resumed["first_step"] == stop_at and resumed["last_step"] == straight["last_step"] == steps
    return straight, resumed
