"""``python -m maxlm.data clean ... --engine ray [--address ADDR]``: the clean stages on a Ray cluster.

The same stages as the single-machine engine (maxlm.data.clean), through the same per-document
functions, laid out as Ray Data tasks so that the heavy work runs on every CPU of a cluster:

    read, normalise, quality, exact key, MinHash signature, PII
        ``map_batches`` over blocks of document indices: each task reads its documents from the
        source and runs ``clean._process_record`` on them (the function the local engine's worker
        processes run). Materialised in the object store: one row per document.
    exact_dedup
        A shuffle on the blake2b key: rows (partition of the key, key, index) are grouped by
        partition (``groupby("part").map_groups``), so equal keys meet in one task, which finds the
        repeats in one vectorised pass (sort, compare neighbours; no Python call per key). The
        first copy is kept, as locally.
    near_dedup
        ``map_batches`` cuts every signature into the LSH bands datasketch's MinHashLSH would use
        (``dedup.lsh_params``), one row per (band hash, document); the same shuffle on the band
        hash brings documents that share a band together across machines, giving the pairs
        (document, first document of the band). They are the edges of a small graph whose
        connected components the driver finds (union-find). A last shuffle on the component runs
        ``dedup.NearDedup`` (the local engine's class) over each component with more than one
        document, in source order. The local engine's rule (a document is dropped when its best
        LSH candidate among the documents already kept reaches the threshold; ties to the earliest)
        only ever looks at LSH candidates, and candidates share a band, so they lie in one
        component: the same documents are kept, with the same ``duplicate_of``. (Keeping "the first
        document of each component" would not be the same: in a chain A ~ B ~ C with C far from A,
        the local rule keeps A and C.)
    writing
        The driver streams the rows back in source order and books them through the local engine's
        own code (``clean._account``), so report.json counts, ``audit/dropped.jsonl`` and the
        ``part-NNNNN.jsonl`` shards are the ones the local engine writes (report.json differs only in
        its timing and ``engine`` fields).

Local by default (``ray.init(num_cpus=--workers)`` on this machine), any running cluster by
``--address`` (``auto``, ``HOST:PORT`` or ``ray://HOST:PORT``); maxlm must be importable on the
cluster's nodes. Ray is an extra: ``pip install 'maxlm[ray]'``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import pickle
import socket

import numpy as np

from maxlm.data import clean, dedup

INSTALL = "pip install 'maxlm[ray]'"


def check() -> None:
    """Raise one readable ValueError when Ray Data is not installed."""
    try:
        import ray  # noqa: F401
        import ray.data  # noqa: F401
    except ImportError as err:
        raise ValueError(f"--engine ray needs Ray Data, which is not installed ({err}): {INSTALL}") from None


def _check_address(address: str) -> None:
    """A quick probe of HOST:PORT (TCP, then an HTTP/2 handshake, as Ray's gRPC ports answer), so a
    wrong --address is one line within seconds rather than minutes of Ray's own retries."""
    if address == "auto":
        return
    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--address {address}: give auto, HOST:PORT or ray://HOST:PORT of a Ray cluster")
    try:
        with socket.create_connection((host, int(port)), timeout=5) as conn:
            # Ray's head speaks gRPC: an HTTP/2 client preface is answered by a SETTINGS frame.
            conn.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
            reply = b""
            while len(reply) < 9:
                chunk = conn.recv(9 - len(reply))
                if not chunk:
                    break
                reply += chunk
    except socket.timeout:
        reply = b""
    except OSError as err:
        raise ValueError(f"--address {address}: no Ray cluster answers there ({err.strerror or err})") from None
    if len(reply) < 9 or reply[3] != 4:
        raise ValueError(f"--address {address}: something answers there, but not a Ray cluster (no gRPC "
                         "reply); give the head node's GCS port (6379 by default) or ray://HOST:10001")


@contextlib.contextmanager
def session(address: str = "", workers: int = 0, progress: bool = True):
    """Connect to Ray for the duration: the cluster at ``address``, or a new local instance with
    ``workers`` CPUs (at least 1). An instance already started in this process (``ray.init`` by the
    caller) is used as it is and left running. Yields the report's ``engine`` entry."""
    import ray

    if address:
        _check_address(address)
    started = False
    if not ray.is_initialized():
        kwargs = dict(include_dashboard=False, logging_level=logging.ERROR, log_to_driver=progress)
        try:
            if address:
                ray.init(address=address, **kwargs)
            else:
                ray.init(address="local", num_cpus=max(workers, 1), **kwargs)  # never a stale cluster
        except (ConnectionError, RuntimeError, ValueError, TimeoutError) as err:
            why = " ".join(str(err).split())[:300]
            if address:  # Ray 2.59+ starts clusters with token authentication on
                raise ValueError(f"--address {address}: could not join the Ray cluster ({why}); if it uses "
                                 "token authentication, set RAY_AUTH_MODE=token (and RAY_AUTH_TOKEN or "
                                 "~/.ray/auth_token as on the cluster)") from None
            raise ValueError(f"a local Ray instance did not start ({why})") from None
        started = True
    try:
        info = {"name": "ray", "address": address or "local", "cpus": int(ray.cluster_resources().get("CPU", 0))}
        yield info if address else {**info, "workers": workers}
    finally:
        if started:
            ray.shutdown()


# ---- the tasks: module-level functions, so Ray pickles them by reference ------------------------

def _process_block(batch, src, opts):
    """Read documents ``batch["id"]`` and run the local engine's per-document stages on them."""
    import pyarrow as pa

    idx = batch["id"].to_pylist()
    keys, sigs, payloads = [], [], []
    for i in idx:
        rec, res = clean._process_record(src.read(i), opts)
        key = sig = None
        if res is not None:
            key, sig = res.pop("key", None), res.pop("sig", None)
        keys.append(key.hex() if key is not None else "")
        sigs.append(sig.tobytes() if sig is not None else b"")
        payloads.append(pickle.dumps((rec, res), protocol=pickle.HIGHEST_PROTOCOL))
    return pa.table({"idx": pa.array(idx, pa.int64()), "key": pa.array(keys, pa.string()),
                     "sig": pa.array(sigs, pa.binary()), "payload": pa.array(payloads, pa.binary())})


def _keyed(batch, parts):
    """(part, key, idx) of the documents that reached exact dedup; part: the key's shuffle partition."""
    import pyarrow as pa
    import pyarrow.compute as pc

    batch = batch.select(["key", "idx"]).filter(pc.not_equal(batch["key"], ""))
    part = [int(k[:15], 16) % parts for k in batch["key"].to_pylist()]  # the key is a hash already
    return batch.append_column("part", pa.array(part, pa.int64()))


def _repeats(group):
    """Within one shuffle partition: (key, idx, first) for every row whose key an earlier row (by
    idx) of the partition has; ``first`` is that earliest row's idx. Vectorised: one call per
    partition, not per key."""
    group = group.sort_by([("key", "ascending"), ("idx", "ascending")])
    key = group["key"].to_numpy(zero_copy_only=False)
    idx = group["idx"].to_numpy()
    start = np.ones(len(key), dtype=bool)
    start[1:] = key[1:] != key[:-1]
    first = idx[start][np.cumsum(start) - 1]
    return {"key": key[~start], "idx": idx[~start], "first": first[~start]}


def _near_inputs(batch, first):
    """(idx, sig) of the documents that reach near dedup: a signature, and not an exact repeat."""
    import pyarrow as pa

    keep = [bool(s) and first.get(k, i) == i for i, k, s in
            zip(batch["idx"].to_pylist(), batch["key"].to_pylist(), batch["sig"].to_pylist())]
    return batch.select(["idx", "sig"]).filter(pa.array(keep, pa.bool_()))


def _band_rows(batch, bands, rows, num_perm, parts):
    """One row per (band, document): a 64-bit hash of the band's ``rows`` MinHash values (and the
    shuffle partition it goes to). Equal
    bands give equal hashes; a collision of unequal ones only joins two components, which changes
    nothing (NearDedup re-checks every candidate inside a component)."""
    idx = batch["idx"].to_numpy()
    sig = np.frombuffer(b"".join(batch["sig"].to_pylist()), dtype=np.uint32).reshape(len(idx), num_perm)
    sig = sig.astype(np.uint64)
    out_band, out_idx = [], []
    with np.errstate(over="ignore"):
        for b in range(bands):
            h = np.full(len(idx), b + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
            for c in range(b * rows, (b + 1) * rows):
                h = dedup._mix(h ^ sig[:, c])
            out_band.append(h.view(np.int64))
            out_idx.append(idx)
    band = np.concatenate(out_band)
    part = (band.view(np.uint64) % np.uint64(parts)).astype(np.int64)
    return {"key": band, "idx": np.concatenate(out_idx), "part": part}


def _tag_components(batch, component, parts):
    comp = np.array([component.get(int(i), -1) for i in batch["idx"]], dtype=np.int64)
    hit = comp >= 0
    return {"part": comp[hit] % parts, "comp": comp[hit], "idx": batch["idx"][hit], "sig": batch["sig"][hit]}


def _near_in_components(group, threshold, num_perm, shingle):
    """The local engine's near-dedup rule (a fresh NearDedup) over each component of the
    partition, the component's documents in source order: (idx, of, j) of each document dropped."""
    out_idx, out_of, out_j = [], [], []
    order = np.lexsort((group["idx"], group["comp"]))
    comp, idx, sig = group["comp"][order], group["idx"][order], group["sig"][order]
    near = None
    for k in range(len(order)):
        if k == 0 or comp[k] != comp[k - 1]:
            near = dedup.NearDedup(threshold, num_perm, shingle)
        of, j = near.add(str(int(idx[k])), np.frombuffer(sig[k], dtype=np.uint32))
        if of is not None:
            out_idx.append(int(idx[k]))
            out_of.append(int(of))
            out_j.append(j)
    return {"idx": np.array(out_idx, np.int64), "of": np.array(out_of, np.int64),
            "j": np.array(out_j, np.float64)}


# ---- the driver ---------------------------------------------------------------------------------

class PlannedDedup:
    """The dedup decisions the cluster made, answered as clean._account books documents in order
    (the same questions as clean.LocalDedup)."""

    def __init__(self, first: dict[str, int], drops: dict[int, tuple[int, float]]):
        self.first, self.drops = first, drops
        self.targets = {of for of, _ in drops.values()}
        self.ids: dict[int, str] = {}

    def exact_duplicate(self, index: int, key: str) -> bool:
        return self.first.get(key, index) != index

    def near_duplicate(self, index: int, doc_id: str, sig) -> tuple[str | None, float]:
        if index in self.targets:
            self.ids[index] = doc_id
        if index in self.drops:
            of, j = self.drops[index]
            return self.ids[of], j
        return None, 0.0


def _components(edges: list[tuple[int, int]]) -> dict[int, int]:
    """Union-find: document -> smallest document of its connected component (documents in edges)."""
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        root = x
        while parent.setdefault(root, root) != root:
            root = parent[root]
        while parent[x] != root:
            parent[x], x = root, parent[x]
        return root
    for a, b in edges:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    return {x: find(x) for x in parent}


def _shuffled_repeats(ds) -> list[dict]:
    """Rows (key, idx, part) -> rows (key, idx, first) for each row whose key an earlier row has:
    a groupby on the partition of the key (a shuffle that brings equal keys to one task), then
    one vectorised pass per partition."""
    return ds.groupby("part").map_groups(_repeats, batch_format="pyarrow").take_all()


def _ordered(processed, total: int):
    """(record, result) pairs back on the driver, in source order."""
    expect = 0
    for batch in processed.iter_batches(batch_format="pyarrow", batch_size=256, prefetch_batches=4):
        for i, key, payload in zip(batch["idx"].to_pylist(), batch["key"].to_pylist(),
                                   batch["payload"].to_pylist()):
            if i != expect:
                raise RuntimeError(f"Ray returned document {i} where {expect} was due")
            expect += 1
            rec, res = pickle.loads(payload)
            if res is not None:
                res["key"], res["sig"] = key or None, None
            yield rec, res
    if expect != total:
        raise RuntimeError(f"Ray returned {expect} of {total} documents")


def run(src, total: int, opts: clean.CleanOptions, progress: bool = True):
    """((record, result) pairs in source order, PlannedDedup): the per-document stages and the
    dedup decisions, computed by Ray Data on the connected cluster (see the module docstring)."""
    import ray

    ctx = ray.data.DataContext.get_current()
    saved = (ctx.execution_options.preserve_order, ctx.enable_progress_bars, ctx.shuffle_strategy)
    ctx.execution_options.preserve_order = True  # blocks come back in source order
    ctx.enable_progress_bars = progress
    # Sort-based shuffles run as plain tasks; the hash shuffle starts aggregator actors per
    # groupby, seconds each on a small cluster.
    ctx.shuffle_strategy = ray.data.context.ShuffleStrategy.SORT_SHUFFLE_PULL_BASED
    log = logging.getLogger("ray.data")
    level = log.level
    if not progress:
        log.setLevel(logging.ERROR)
    try:
        return _run(src, total, opts)
    finally:
        ctx.execution_options.preserve_order, ctx.enable_progress_bars, ctx.shuffle_strategy = saved
        log.setLevel(level)


def _run(src, total: int, opts: clean.CleanOptions):
    import ray

    if total == 0:
        return iter(()), PlannedDedup({}, {})
    cpus = max(int(ray.cluster_resources().get("CPU", 1)), 1)
    # Blocks of at least ~500 documents (a task costs milliseconds of scheduling), a few per CPU.
    blocks = max(1, min(math.ceil(total / 500), cpus * 4))
    # Partitions of the dedup shuffles: one per CPU, more when one would hold over ~5M band rows.
    parts = max(1, min(blocks, cpus), math.ceil(total / 200_000))
    processed = (ray.data.range(total, override_num_blocks=blocks)
                 .map_batches(_process_block, batch_size=None, batch_format="pyarrow",
                              fn_kwargs={"src": src, "opts": opts})
                 .materialize())
    first: dict[str, int] = {}
    if opts.exact_dedup:  # shuffle on the exact key: which documents repeat an earlier one
        keyed = processed.map_batches(_keyed, batch_size=None, batch_format="pyarrow", fn_kwargs={"parts": parts})
        first = {r["key"]: int(r["first"]) for r in _shuffled_repeats(keyed)}
    drops: dict[int, tuple[int, float]] = {}
    if opts.near_dedup:
        bands, rows = dedup.lsh_params(opts.near_threshold, opts.num_perm)
        sigs = (processed.map_batches(_near_inputs, batch_size=None, batch_format="pyarrow",
                                      fn_kwargs={"first": first})
                .repartition(parts).materialize())
        band_rows = sigs.map_batches(_band_rows, batch_size=None, batch_format="pyarrow",
                                     fn_kwargs={"bands": bands, "rows": rows, "num_perm": opts.num_perm,
                                                "parts": parts})
        # Shuffle on the band hash: documents sharing a band meet; (idx, first idx of the band).
        edges = [(int(r["idx"]), int(r["first"])) for r in _shuffled_repeats(band_rows)]
        if edges:
            component = _components(edges)
            found = (sigs.map_batches(_tag_components, batch_size=None, batch_format="numpy",
                                      fn_kwargs={"component": component, "parts": parts})
                     .groupby("part")
                     .map_groups(_near_in_components, batch_format="numpy",
                                 fn_kwargs={"threshold": opts.near_threshold, "num_perm": opts.num_perm,
                                            "shingle": opts.shingle})
                     .take_all())
            drops = {int(r["idx"]): (int(r["of"]), float(r["j"])) for r in found}
    return _ordered(processed, total), PlannedDedup(first, drops)


__all__ = ["INSTALL", "PlannedDedup", "check", "run", "session"]
