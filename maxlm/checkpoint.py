"""Checkpoints on Orbax: the train state, the data-iterator state and the config, saved async.

Layout of a run directory::

    RUN_DIR/checkpoints/<step>/state/    TrainState arrays (OCDBT/tensorstore; restored with any sharding)
    RUN_DIR/checkpoints/<step>/data/     data-iterator state (JSON)
    RUN_DIR/checkpoints/<step>/config/   the operative config (JSON)

Parameters alone (``save_params``/``restore_params``) use the same array format under one folder;
``maxlm.hf import`` writes them and ``TrainConfig.init_params`` reads them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from maxlm.config import CheckpointConfig


def _abstract(tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs carrying the target shardings, so Orbax places each shard directly."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


class Checkpointer:
    """Saves and restores (state, data-iterator state, config) by step in RUN_DIR/checkpoints."""

    def __init__(self, run_dir: str | Path, cfg: CheckpointConfig):
        self.directory = Path(run_dir).expanduser().resolve() / "checkpoints"  # Orbax wants absolute
        self.cfg = cfg
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.max_to_keep, enable_async_checkpointing=cfg.async_save, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "data", "config"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, data_state: dict | None, config: dict, force: bool = False) -> bool:
        """Start a save (async: returns once the arrays are copied off the devices)."""
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  data=ocp.args.JsonSave(data_state or {}),
                                  config=ocp.args.JsonSave(config))
        return self.manager.save(step, args=args, force=force)

    def restore(self, step: int, abstract_state: Any, shardings: Any) -> tuple[Any, dict]:
        """(state placed with ``shardings``, data-iterator state) of checkpoint ``step``."""
        args = ocp.args.Composite(state=ocp.args.StandardRestore(_abstract(abstract_state, shardings)),
                                  data=ocp.args.JsonRestore())
        restored = self.manager.restore(step, args=args)
        return restored.state, restored.data

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def save_params(path: str | Path, params: Any) -> None:
    """Write a parameter tree (blocking) to ``path``, which must not exist yet."""
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(Path(path).expanduser().resolve(), params)


def restore_params(path: str | Path, abstract_params: Any, shardings: Any) -> Any:
    """Read a parameter tree written by ``save_params`` onto the given shardings."""
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(Path(path).expanduser().resolve(), _abstract(abstract_params, shardings))
