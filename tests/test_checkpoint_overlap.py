"""A save overlaps training cheaply: uncompressed arrays, background threads at low priority, and
checkpoints written the older way (compressed, StandardCheckpointHandler) still restore and verify."""

import json
import os
import sys
import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from maxlm import config
from maxlm.train import checkpoint


def _tree():
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    rng = np.random.default_rng(0)
    state = {"w": jax.device_put(np.zeros((512, 512), np.float32), one),  # 1 MiB that zstd shrinks to nothing
             "b": jax.device_put(rng.standard_normal(64).astype(np.float32), one)}
    shardings = jax.tree.map(lambda x: x.sharding, state)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    return state, abstract, shardings


def _bytes(step_dir):
    return sum(p.stat().st_size for p in (step_dir / "state").rglob("*") if p.is_file())


def test_arrays_are_written_uncompressed_unless_asked(tmp_path):
    state, abstract, shardings = _tree()
    sizes = {}
    for compress in (False, True):
        ckpt = checkpoint.Checkpointer(tmp_path / str(compress), config.CheckpointConfig(), compress=compress)
        ckpt.save(1, state, {}, {}, {})
        ckpt.wait()
        assert ckpt.problem(1) is None
        restored, _, _ = ckpt.restore(1, abstract, shardings)
        assert all(np.array_equal(restored[k], state[k]) for k in state)
        sizes[compress] = _bytes(ckpt.directory / "1")
        ckpt.close()
    assert sizes[False] >= 512 * 512 * 4 > 10 * sizes[True]


def test_a_checkpoint_saved_the_older_way_restores_and_verifies(tmp_path):
    """Before, the state went through StandardCheckpointHandler with zstd: such a run resumes."""
    state, abstract, shardings = _tree()
    directory = tmp_path / "checkpoints"
    handlers = {"state": ocp.StandardCheckpointHandler(), "data": checkpoint.DataStateHandler(),
                "config": ocp.JsonCheckpointHandler()}
    with ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=True),
                               item_handlers=handlers) as old:
        old.save(5, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                            data=checkpoint.DataStateSave({"pos": 7}),
                                            config=ocp.args.JsonSave({"a": 1})))
        old.wait_until_finished()
    step_dir = directory / "5"
    manifest = {"step": 5, "files": checkpoint._hash_files(step_dir)}
    (step_dir / checkpoint.MANIFEST).write_text(json.dumps(manifest))

    ckpt = checkpoint.Checkpointer(tmp_path, config.CheckpointConfig())
    found = ckpt.restore_latest_good(abstract, shardings)
    assert found is not None and found[0] == 5 and found[2] == {"pos": 7}
    assert all(np.array_equal(found[1][k], state[k]) for k in state)
    ckpt.close()


def _save_and_see_finisher_lowered(tmp_path, state):
    """Start a save; return (checkpointer, finisher thread) once the finisher runs at low priority."""
    ckpt = checkpoint.Checkpointer(tmp_path, config.CheckpointConfig())
    ckpt.save(1, state, {}, {}, {})
    finisher = ckpt._finisher
    deadline = time.monotonic() + 1.0
    while os.getpriority(os.PRIO_PROCESS, finisher.native_id) != checkpoint.BACKGROUND_NICE:
        assert time.monotonic() < deadline, "the finisher never lowered its priority"
    return ckpt, finisher


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_background_work_runs_at_low_priority_and_training_does_not(tmp_path, monkeypatch):
    monkeypatch.setenv("MAXLM_TEST_MANIFEST_DELAY_S", "1.5")  # hold the finisher after the write
    state, _, _ = _tree()
    main_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    ckpt, finisher = _save_and_see_finisher_lowered(tmp_path, state)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_nice  # the caller is untouched
    ckpt.wait()
    assert ckpt.problem(1) is None
    ckpt.close()


def _can_raise_priority() -> bool:
    tid = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, tid)
    result = {}

    def probe():  # on a throwaway thread: lower it, then try to raise it back
        me = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, me, before + 1)
        try:
            os.setpriority(os.PRIO_PROCESS, me, before)
            result["ok"] = True
        except OSError:
            result["ok"] = False
    t = threading.Thread(target=probe)
    t.start()
    t.join()
    return result["ok"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_waiting_for_a_save_gives_its_threads_normal_priority_back(tmp_path, monkeypatch):
    if not _can_raise_priority():
        pytest.skip("raising a thread's priority needs CAP_SYS_NICE or RLIMIT_NICE here")
    monkeypatch.setenv("MAXLM_TEST_MANIFEST_DELAY_S", "1.0")
    state, _, _ = _tree()
    normal = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    ckpt, finisher = _save_and_see_finisher_lowered(tmp_path, state)
    ckpt._priority.raise_back()  # what wait(), close() and the next save() do before joining
    assert os.getpriority(os.PRIO_PROCESS, finisher.native_id) == normal
    ckpt.wait()
    ckpt.save(2, state, {}, {}, {})  # the next save lowers its threads again
    ckpt.close()
    assert ckpt.problem(2) is None
