"""Small models, batches and training runs shared by the tests."""

import jax
import numpy as np

from maxlm import config, optim, sharding, step


def small_config(num_devices=8, model=None, **sections):
    """A model that compiles in seconds; grouped-query attention unless overridden."""
    base = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=128, vocab_multiple=8,
                max_seq_len=64, dtype="float32")
    base.update(model or {})
    train = dict(global_batch=8, seq_len=32, steps=10)
    train.update(sections.pop("train", {}))
    opt = dict(warmup_steps=2, learning_rate=1e-2)
    opt.update(sections.pop("optim", {}))
    return config.build(num_devices=num_devices, model=base, train=train, optim=opt, **sections)


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
        train_step, _ = step.compile_steps(cfg, mesh, optimizer, shardings)
        for i in range(steps):
            batch = batches[i] if batches else fixed
            state, metrics = train_step(state, step.device_batch(batch, mesh))
            losses.append(float(metrics["loss"]))
    return np.array(losses), state
