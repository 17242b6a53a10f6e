"""Checkpoints on Orbax: train state, data-iterator state and config, saved async and verified.

Layout of a run directory::

    RUN_DIR/checkpoints/<step>/state/        TrainState arrays (OCDBT/tensorstore; restores onto any mesh)
    RUN_DIR/checkpoints/<step>/data/         data-iterator state, one JSON file per process
    RUN_DIR/checkpoints/<step>/config/       the operative config (JSON)
    RUN_DIR/checkpoints/<step>/manifest.json step, tokens seen, config hash, sha256 of every file
    RUN_DIR/checkpoints_rejected/<step>-<reason>/   checkpoints that failed verification, kept aside

Orbax writes each step into a temporary folder and renames it when complete, so a crash mid-save
never touches the previous checkpoint. In a bucket (``gs://``, ``s3://``: ``maxlm.storage``), which
has no rename, Orbax writes the step in place and marks it complete with a commit file. The manifest is written last, after Orbax has committed the
step and its files were hashed: a step without a manifest is an interrupted save, and a file whose
hash differs is corrupt. Both are moved aside (never deleted) and the previous good step is used.

Saves overlap training at little cost. Arrays are written uncompressed: on a trained float32
state zstd saved about 7% of the bytes for about 40% more CPU per save. The background work of a
save (Orbax's threads, tensorstore's writer threads, the hashing thread) runs at the lowest CPU
priority (nice 19, per thread, on Linux), so on a CPU-bound host it takes the cycles the training
step leaves idle rather than the step's; when the caller waits for a save (the next save, ``wait``,
``close``) its threads get the caller's priority back, where the system allows raising it.

Parameters alone (``save_params``/``restore_params``) use the same array format under one folder;
``maxlm.hf import`` writes them and ``TrainConfig.init_params`` reads them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import jax
import orbax.checkpoint as ocp

from maxlm import storage
from maxlm.config import CheckpointConfig

MANIFEST = "manifest.json"
# Niceness of a save's background threads while training runs (Linux only; 0: the training's own).
BACKGROUND_NICE = 19
# Orbax writes the arrays without compression unless asked (see the module docstring).
COMPRESS_ARRAYS = False


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked (the message is one line for the user)."""


class DataStateHandler(ocp.CheckpointHandler):
    """Each process's data-iterator state in its own file: processes read different shards and
    stand at different positions, so one process's state cannot stand for all (as in Grain's)."""

    @staticmethod
    def _file(directory) -> Path:
        return storage.path(directory) / f"process_{jax.process_index()}-of-{jax.process_count()}.json"

    def save(self, directory, args: "DataStateSave") -> None:
        self._file(directory).write_text(json.dumps(args.state))

    def restore(self, directory, args: "DataStateRestore | None" = None) -> dict:
        path = self._file(directory)
        if not path.exists():
            saved = sorted(p.name for p in storage.path(directory).glob("process_*.json"))
            raise CheckpointError(f"{path} is missing: the data state was saved by {saved} "
                                  f"(another process count?)")
        return json.loads(path.read_text())

    def metadata(self, directory) -> None:
        return None

    def finalize(self, directory) -> None:
        pass

    def close(self) -> None:
        pass


@ocp.args.register_with_handler(DataStateHandler, for_save=True)
@dataclasses.dataclass
class DataStateSave(ocp.args.CheckpointArgs):
    state: dict


@ocp.args.register_with_handler(DataStateHandler, for_restore=True)
@dataclasses.dataclass
class DataStateRestore(ocp.args.CheckpointArgs):
    pass


def _abstract(tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs carrying the target shardings, so Orbax places each shard directly."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _key_name(key: Any) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _shapes(tree: Any) -> dict[str, tuple]:
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
    return {"/".join(_key_name(k) for k in path): tuple(leaf.shape) for path, leaf in leaves}


def _state_handler(compress: bool) -> ocp.PyTreeCheckpointHandler:
    """Orbax's array handler as StandardCheckpointHandler configures it (OCDBT, 96 GB in flight),
    with compression chosen here. Checkpoints written compressed (by older maxlm) restore as well:
    each array's codec is recorded with it."""
    return ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_compression=compress,
                                       save_concurrent_gb=96, restore_concurrent_gb=96)


class _Priority:
    """Lowers the CPU priority of a save's background threads while training runs, and raises it
    back while the caller waits for the save (nothing to protect then). Per thread, Linux only
    (elsewhere setpriority's 'process' is the whole process): a no-op on other systems.

    Raising needs CAP_SYS_NICE or RLIMIT_NICE; without them a lowered thread stays low, and a save
    the caller waits for finishes at the background priority: quickly on a host that runs only
    the training (its threads are idle while it waits), slowly where other normal-priority
    processes keep every core busy (nice 19 gets about 1.5% of a contended core)."""

    def __init__(self, nice: int):
        self.nice = nice if sys.platform.startswith("linux") else 0
        self.normal = os.getpriority(os.PRIO_PROCESS, 0) if self.nice else 0  # the caller's
        self.lowered: set[int] = set()
        self.waiting = True  # until a save starts
        self.lock = threading.Lock()

    def lower(self, tids) -> None:
        if not self.nice:
            return
        with self.lock:
            if self.waiting:
                return
            for tid in tids:
                try:
                    if os.getpriority(os.PRIO_PROCESS, tid) < self.nice:
                        os.setpriority(os.PRIO_PROCESS, tid, self.nice)
                    self.lowered.add(tid)
                except OSError:  # the thread has exited, or the system refuses
                    pass

    def start(self) -> None:
        with self.lock:
            self.waiting = False

    def raise_back(self) -> None:
        """The caller is about to wait for the save: let it finish at the caller's priority."""
        with self.lock:
            self.waiting = True
            for tid in self.lowered:
                try:
                    os.setpriority(os.PRIO_PROCESS, tid, self.normal)
                except OSError:  # exited, or no privilege to raise: stays low
                    pass
            self.lowered.clear()


def _tensorstore_threads() -> list[int]:
    """Kernel ids of tensorstore's pool threads (its overseer starts the workers, which inherit
    its niceness). Only checkpoints use tensorstore in maxlm."""
    found = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith("ts_pool"):
                    found.append(int(tid))
        except OSError:
            continue
    return found


def _hash_files(step_dir: Path) -> dict[str, str]:
    hashes = {}
    for path in (p for p in storage.files_under(step_dir) if p.name != MANIFEST):
        digest = hashlib.sha256()
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        hashes[str(path.relative_to(step_dir))] = digest.hexdigest()
    return hashes


@contextlib.contextmanager
def _stragglers_muted() -> Iterator[None]:
    """When a save fails, tensorstore's pending writes call back into Orbax's already closed event
    loop and each prints a traceback ("Event loop is closed"), during the save and after it. They
    say nothing the one-line error does not: stderr goes to /dev/null while a save runs, and stays
    there if it fails (the run is about to stop; the CLI prints its line to the real stderr)."""
    saved = sys.stderr
    sys.stderr = open(os.devnull, "w")
    yield  # an exception leaves from here, with stderr still muted
    sys.stderr.close()
    sys.stderr = saved


# What the operating system said, as tensorstore and Orbax quote it inside longer messages.
_OS_ERRORS = ("No space left on device", "Read-only file system", "Permission denied",
              "No such file or directory", "Disk quota exceeded")


def _reason(err: BaseException) -> str:
    """The cause of a failed save in a few words (the library's full text goes to library.log)."""
    text = str(err)
    for known in _OS_ERRORS:
        if known in text:
            return known
    return f"{type(err).__name__}: {' '.join(text.split())[:200]}"


def checkpoint_problem(step_dir: Path) -> str | None:
    """Why the checkpoint in ``step_dir`` cannot be trusted, or None when its manifest and hashes
    check out. Reads only."""
    manifest_path = step_dir / MANIFEST
    if not manifest_path.exists():
        return "incomplete (no manifest: the save was interrupted)"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as err:
        return f"unreadable manifest ({err})"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files", {}), dict):
        return "unreadable manifest (not a JSON object with a 'files' object)"
    expected = manifest.get("files", {})
    if not expected:
        return None
    actual = _hash_files(step_dir)
    for name, digest in expected.items():
        if name not in actual:
            return f"missing file {name}"
        if actual[name] != digest:
            return f"file {name} fails its sha256"
    return None


def _atomicity(run_dir) -> dict:
    """A bucket has no rename: its steps are written in place and committed by a commit file
    (Orbax >= 0.12.8). Local directories keep Orbax's default, the atomic rename."""
    if not storage.is_remote(run_dir):
        return {}
    return {"atomicity_options": ocp.options.AtomicityOptions(mode=ocp.options.AtomicityMode.COMMIT_FILE)}


def config_hash(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


class Checkpointer:
    """Saves (async) and restores (state, data-iterator state, config) by step in RUN_DIR/checkpoints."""

    def __init__(self, run_dir: str | Path, cfg: CheckpointConfig, log: Callable[[str], None] = print,
                 compress: bool = COMPRESS_ARRAYS):
        run_dir = storage.absolute(run_dir)  # Orbax wants absolute paths
        self.directory = run_dir / "checkpoints"
        self.rejected_dir = run_dir / "checkpoints_rejected"
        self.cfg, self.log = cfg, log
        self.is_writer = jax.process_index() == 0
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.max_to_keep, keep_period=cfg.keep_every_steps or None,
            enable_async_checkpointing=cfg.async_save, create=True,
            **_atomicity(run_dir))
        handlers = {"state": _state_handler(compress), "data": DataStateHandler(),
                    "config": ocp.JsonCheckpointHandler()}
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        self._finisher: threading.Thread | None = None
        self._error: BaseException | None = None
        self._priority = _Priority(BACKGROUND_NICE if cfg.async_save else 0)
        self._last_save_time = time.monotonic()

    # ---- saving -------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether ``step`` should be saved: every N steps and/or every M minutes."""
        by_steps = self.cfg.every_steps and step % self.cfg.every_steps == 0
        by_time = self.cfg.every_minutes and time.monotonic() - self._last_save_time >= 60 * self.cfg.every_minutes
        return bool(by_steps or by_time)

    def save(self, step: int, state: Any, data_state: dict | None, config: dict, info: dict) -> None:
        """Start a save. Returns once the arrays are copied off the devices; Orbax writes them in
        the background and a finisher thread then hashes the files and writes the manifest, all
        at low priority (``BACKGROUND_NICE``) while training continues."""
        self._join_finisher()
        args = ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                                  data=DataStateSave(data_state or {}),
                                  config=ocp.args.JsonSave(config))
        before = {t.ident for t in threading.enumerate()}
        try:
            with _stragglers_muted():
                self.manager.save(step, args=args, force=True)
        except Exception as err:  # noqa: BLE001 - Orbax and tensorstore raise OSError or ValueError
            raise CheckpointError(f"saving checkpoint {step} to {self.directory} failed: {_reason(err)}; "
                                  "the previous checkpoints are intact") from None
        self._last_save_time = time.monotonic()
        # The arrays are off the devices: from here on the save competes with the training steps.
        # Its threads: those Orbax started for it, and tensorstore's pool (kept between saves).
        self._priority.start()
        self._priority.lower([t.native_id for t in threading.enumerate()
                              if t.ident not in before and t.native_id is not None])
        self._priority.lower(_tensorstore_threads())
        manifest = {"step": step, "config_hash": config_hash(config), "saved_at": time.time(), **info}
        self._finisher = threading.Thread(target=self._finish, args=(step, manifest),
                                          name="maxlm-checkpoint-finisher", daemon=True)
        self._finisher.start()

    def _finish(self, step: int, manifest: dict) -> None:
        self._priority.lower([threading.get_native_id()])
        try:
            if self._priority.nice:  # tensorstore starts workers as the write proceeds: lower them too
                while self.manager.is_saving_in_progress():
                    self._priority.lower(_tensorstore_threads())
                    time.sleep(0.05)
            self.manager.wait_until_finished()
            # Fault-injection hook for tests: hold back the manifest (of one step only, if given).
            delay = os.environ.get("MAXLM_TEST_MANIFEST_DELAY_S")
            only = os.environ.get("MAXLM_TEST_MANIFEST_DELAY_STEP")
            if delay and (not only or int(only) == step):
                time.sleep(float(delay))
            if self.is_writer:
                step_dir = self.directory / str(step)
                manifest["files"] = _hash_files(step_dir) if self.cfg.verify_hashes else {}
                storage.write_atomic(step_dir / MANIFEST, json.dumps(manifest, indent=1))
        except BaseException as err:  # surfaced on the main thread by wait() or the next save()
            self._error = err

    def _join_finisher(self) -> None:
        self._priority.raise_back()  # the caller waits: let the save finish at full priority
        if self._finisher is not None:
            self._finisher.join()
            self._finisher = None
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(f"writing a checkpoint under {self.directory} failed: {_reason(err)}; "
                                  "the previous checkpoints are intact (details in library.log)") from None

    def wait(self) -> None:
        """Block until the last save is complete and verified on disk."""
        self._join_finisher()

    def close(self) -> None:
        try:
            self._join_finisher()
        except CheckpointError:
            with contextlib.suppress(Exception):  # Orbax re-raises the same failure: said in one line already
                self.manager.close()
            raise
        self.manager.close()

    def abandon(self) -> None:
        """Close after a failure elsewhere: wait for the save in flight, report nothing more."""
        try:
            self.close()
        except Exception:  # noqa: BLE001 - the error being raised already says what went wrong
            pass

    # ---- restoring ----------------------------------------------------------------------------

    def steps(self) -> list[int]:
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def problem(self, step: int) -> str | None:
        """Why ``step`` cannot be trusted, or None when its manifest and hashes check out."""
        return checkpoint_problem(self.directory / str(step))

    def _move_aside(self, step: int, folder: Path, label: str) -> None:
        if self.is_writer:
            folder.mkdir(parents=True, exist_ok=True)
            storage.move_tree(self.directory / str(step), folder / f"{step}-{label}-{int(time.time())}")
        self.manager.reload()

    def reject(self, step: int, reason: str) -> None:
        """Move a bad checkpoint aside (never delete it) and say so."""
        self.log(f"checkpoint {self.directory / str(step)} is unusable: {reason}; "
                 f"moving it to {self.rejected_dir} and trying the previous one")
        self._move_aside(step, self.rejected_dir, reason.split(" ")[0].strip("(:"))

    def supersede_after(self, step: int) -> None:
        """Resuming from an earlier step abandons the later checkpoints: keep them aside."""
        later = [s for s in self.steps() if s > step]
        if later:
            folder = self.directory.parent / "checkpoints_superseded"
            self.log(f"resuming from step {step}: moving the later checkpoints {later} to {folder}")
            for s in later:
                self._move_aside(s, folder, "superseded")

    def check_matches(self, step: int, abstract_state: Any) -> None:
        """Fail with one line naming every parameter whose shape differs from the model's."""
        saved = _shapes(self.manager.item_metadata(step).state)
        wanted = _shapes(abstract_state)
        diffs = [f"{k}: checkpoint {saved.get(k, 'missing')} vs model {v}"
                 for k, v in wanted.items() if saved.get(k) != v]
        diffs += [f"{k}: in the checkpoint but not in the model" for k in saved if k not in wanted]
        if diffs:
            raise CheckpointError(f"checkpoint {self.directory / str(step)} does not match the model "
                                  f"({len(diffs)} arrays differ): " + "; ".join(diffs[:6])
                                  + ("; ..." if len(diffs) > 6 else ""))

    def restore(self, step: int, abstract_state: Any, shardings: Any) -> tuple[Any, dict, dict]:
        """(state placed with ``shardings``, data-iterator state, manifest) of checkpoint ``step``."""
        self.check_matches(step, abstract_state)
        target = _abstract(abstract_state, shardings)
        restore_args = ocp.checkpoint_utils.construct_restore_args(target)
        args = ocp.args.Composite(state=ocp.args.PyTreeRestore(target, restore_args=restore_args),
                                  data=DataStateRestore())
        restored = self.manager.restore(step, args=args)
        manifest_path = self.directory / str(step) / MANIFEST
        manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
        return restored.state, restored.data, manifest if isinstance(manifest, dict) else {}

    def restore_latest_good(self, abstract_state: Any, shardings: Any, before: int | None = None):
        """Restore the newest verified checkpoint (at or below ``before``), rejecting bad ones.

        Returns (step, state, data_state, manifest), or None when there is no usable checkpoint."""
        for step in reversed(self.steps()):
            if before is not None and step > before:
                continue
            reason = self.problem(step)
            if reason is None:
                try:
                    return (step, *self.restore(step, abstract_state, shardings))
                except CheckpointError:
                    raise  # a model mismatch is the user's config, not a damaged checkpoint
                except Exception as err:  # noqa: BLE001 - any failure to read means damaged
                    reason = f"restore failed ({type(err).__name__}: {str(err).splitlines()[0][:200]})"
            self.reject(step, reason)
        return None


def save_params(path: str | Path, params: Any) -> None:
    """Write a parameter tree (blocking) to ``path``, which must not exist yet."""
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(storage.absolute(path), params)


def restore_params(path: str | Path, abstract_params: Any, shardings: Any) -> Any:
    """Read a parameter tree written by ``save_params`` onto the given shardings."""
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(storage.absolute(path), _abstract(abstract_params, shardings))


def restore_state_params(step_dir: str | Path, abstract_params: Any, shardings: Any) -> Any:
    """Only the parameters of a train checkpoint (``RUN_DIR/checkpoints/STEP``), onto the given
    shardings: the optimizer state is never read (generation, evaluation and export need no more)."""
    target = _abstract(abstract_params, shardings)
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    args = ocp.args.PyTreeRestore(item={"params": target}, restore_args={"params": restore_args},
                                  partial_restore=True)
    with ocp.PyTreeCheckpointer() as ckptr:
        return ckptr.restore(storage.absolute(step_dir) / "state", args=args)["params"]
