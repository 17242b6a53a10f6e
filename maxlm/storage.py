"""One file-system layer for every path maxlm reads or writes: local paths, ``gs://`` and ``s3://``.

- Files: ``path()`` gives a ``pathlib.Path`` for a local path and an etils ``epath.Path`` for a
  bucket URL (epath reaches buckets through fsspec: gcsfs for ``gs://``, s3fs for ``s3://``). Both
  have the pathlib API the stack uses (``/``, ``open``, ``read_text``, ``exists``, ``glob``, ...).
- Arrays: Orbax writes checkpoints through tensorstore. It speaks ``gs://`` natively; for ``s3://``
  ``install_orbax_s3()`` gives it tensorstore's own ``s3`` kvstore (see there).
- S3-compatible stores (MinIO, Ceph, R2, a test server): the endpoint is the standard
  ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` environment variable, which botocore and s3fs
  read too, so one setting serves files and arrays; the region ``AWS_REGION`` or
  ``AWS_DEFAULT_REGION``. GCS emulators: ``STORAGE_EMULATOR_HOST`` (gcsfs) and
  ``TENSORSTORE_GCS_HTTP_URL`` (tensorstore).

Object stores have no rename, no append and no flock. What the stack needs instead:
``write_atomic`` (one PUT replaces an object whole), ``LeaseLock`` (a lock object created only if
absent, with a lease that a live holder renews and a dead one lets lapse), and checkpoints whose
commit marker is their manifest (``maxlm.train.checkpoint``: a step without one is incomplete).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Union

REMOTE_SCHEMES = ("gs://", "s3://")
AnyPath = Union[Path, Any]  # pathlib.Path or etils.epath.Path


class _LayoutWarningsOnce(logging.Filter):
    """gcsfs asks GCS's control plane for a bucket's layout before each upload and, when it cannot
    learn it (an emulator, or credentials without the storage-layout permission), warns again on
    every call; thousands of identical lines bury the run's output and, written to a pipe that
    nobody drains, stall the process. The first of each is enough."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "bucket type" not in message and "storage layout" not in message:
            return True
        if message in self.seen:
            return False
        self.seen.add(message)
        return True


logging.getLogger("gcsfs").addFilter(_LayoutWarningsOnce())


def is_remote(location: str | os.PathLike) -> bool:
    return str(location).startswith(REMOTE_SCHEMES)


def path(location: str | os.PathLike) -> AnyPath:
    """The location as a path object: pathlib for local paths (``~`` expanded), epath for buckets."""
    if isinstance(location, Path):
        return location.expanduser()
    text = str(location)
    if is_remote(text):
        from etils import epath

        if text.startswith("s3://"):
            install_orbax_s3()
        return epath.Path(text.rstrip("/"))
    return Path(text).expanduser()


def absolute(location: str | os.PathLike) -> AnyPath:
    """An absolute path (Orbax refuses relative ones); bucket URLs are absolute already."""
    p = path(location)
    return p if is_remote(p) else p.resolve()


def filesystem(location: str | os.PathLike):
    """The fsspec file system behind a bucket URL (for what epath does not offer: recursive moves).
    It is epath's own instance: fsspec caches each instance's listings, and a second instance
    would keep seeing a folder this one moved away (Orbax would then try to delete it again)."""
    from etils.epath import backend

    return backend.fsspec_backend.fs(str(location))


def files_under(directory: AnyPath) -> list[AnyPath]:
    """Every file below ``directory``, sorted. On a bucket one listing call (epath's ``rglob``
    refuses ``**`` there)."""
    if is_remote(directory):
        scheme = str(directory).split("://", 1)[0]
        return [path(f"{scheme}://{key}") for key in sorted(filesystem(directory).find(str(directory)))]
    return sorted(p for p in directory.rglob("*") if p.is_file())


def cache_root() -> Path:
    return Path(os.environ.get("MAXLM_BUCKET_CACHE", "~/.cache/maxlm/buckets")).expanduser()


def local_input(location: str) -> str:
    """A local path standing for ``location``, for readers of local files (numpy memory maps,
    Parquet, tokenizers, globs). A local path comes back with ``~`` expanded. A bucket file, folder
    or glob is downloaded into the bucket cache (``MAXLM_BUCKET_CACHE``, by default
    ``~/.cache/maxlm/buckets/SCHEME/BUCKET/KEY``) and the same file, folder or glob under the cache
    comes back, so the reader sees the bucket's layout. A cached file is kept while its size and
    modification time are the object's (it carries the object's time), else fetched again."""
    if not is_remote(location):
        return os.path.expanduser(location)
    import glob as globlib

    scheme, rest = location.split("://", 1)
    fs = filesystem(location)
    if globlib.has_magic(rest):
        keys = fs.glob(rest)
    elif fs.isdir(rest):
        keys = fs.find(rest)
    else:
        keys = [rest] if fs.exists(rest) else []
    local_root = cache_root() / scheme
    for key in keys:
        target = local_root / key
        size, modified = fs.size(key), round(fs.modified(key).timestamp() * 1e9)  # ns, exact
        if target.is_file() and (target.stat().st_size, target.stat().st_mtime_ns) == (size, modified):
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.part-{os.getpid()}")
        fs.get_file(key, str(tmp))
        os.utime(tmp, ns=(modified, modified))
        os.replace(tmp, target)
    return str(local_root / rest.rstrip("/"))


def upload_tree(local_dir: str | Path, location: AnyPath, last: str | None = None) -> None:
    """Copy a finished local folder to a bucket, the file named ``last`` (its completion marker)
    last: a reader that finds the marker finds everything it lists."""
    files = sorted((p for p in Path(local_dir).rglob("*") if p.is_file()), key=lambda p: (p.name == last, str(p)))
    fs = filesystem(location)
    for file in files:
        fs.put_file(str(file), f"{location}/{file.relative_to(local_dir)}")


def write_atomic(target: AnyPath, text: str) -> None:
    """Replace ``target`` with ``text`` all at once: a crash leaves the old content or the new."""
    if is_remote(target):
        target.write_text(text)  # one PUT: an object store never shows half an object
        return
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, target)


def move_tree(source: AnyPath, target: AnyPath) -> None:
    """Move a folder (a checkpoint step set aside). On a bucket: copy every object, then delete."""
    if is_remote(source):
        fs = filesystem(source)
        fs.copy(str(source), str(target), recursive=True)
        fs.rm(str(source), recursive=True)
        return
    import shutil

    shutil.move(str(source), str(target))


def s3_endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def _s3_kvstore(url: str) -> dict:
    """tensorstore's s3 kvstore for ``s3://bucket/key``, with the endpoint and region of the environment."""
    bucket, _, key = url[len("s3://"):].partition("/")
    spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": key.rstrip("/") + "/"}
    endpoint = s3_endpoint()
    if endpoint:
        spec["endpoint"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        spec["aws_region"] = region
    if os.environ.get("AWS_ACCESS_KEY_ID"):  # else the default chain (profile, instance metadata)
        spec["aws_credentials"] = {"type": "environment"}
    return spec


_installed = False


def install_orbax_s3() -> None:
    """Teach Orbax's kvstore builder ``s3://`` (it knows ``gs://`` and local paths, and would turn
    ``s3://b/x`` into the local path ``s3:/b/x``). Every array Orbax reads or writes gets its kvstore
    spec from ``tensorstore_utils.build_kvstore_tspec``; for an ``s3://`` directory this wraps it:
    the spec is built as for a bucket (OCDBT over an object store, with the read coalescing Orbax
    gives remote storage) and its base becomes tensorstore's ``s3`` driver. Idempotent."""
    global _installed
    if _installed:
        return
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

    original = ts_utils.build_kvstore_tspec

    def build_kvstore_tspec(directory, name=None, **kwargs):
        directory = str(directory)
        if not directory.startswith("s3://"):
            return original(directory, name, **kwargs)
        spec = original("gs://" + directory[len("s3://"):], name, **kwargs)
        return _to_s3(spec)

    ts_utils.build_kvstore_tspec = build_kvstore_tspec
    _installed = True


def _to_s3(spec: Any) -> Any:
    """Replace every gcs kvstore inside a spec built for ``gs://`` by the same location on S3."""
    if isinstance(spec, dict):
        if spec.get("driver") in ("gcs", "gcs_grpc"):
            return _s3_kvstore(f"s3://{spec['bucket']}/{spec.get('path', '')}")
        return {k: _to_s3(v) for k, v in spec.items()}
    if isinstance(spec, list):
        return [_to_s3(v) for v in spec]
    if isinstance(spec, str) and spec.startswith("gs://"):
        return _s3_kvstore("s3://" + spec[len("gs://"):])
    return spec


class LockHeld(RuntimeError):
    """Another live process holds the run directory (the message names it)."""


class LeaseLock:
    """A run directory's lock on an object store: ``RUN_DIR/.lock`` created only if absent (S3
    ``If-None-Match: *``, GCS ``ifGenerationMatch=0``, both through fsspec's exclusive ``xb`` mode),
    holding the holder's pid, host and lease expiry. A thread renews the lease; a holder killed with
    ``kill -9`` stops renewing, and once its lease has lapsed the next process may take the lock over
    (delete, then create-if-absent again, so two takers cannot both win)."""

    def __init__(self, lock_path: AnyPath, lease_s: float = 60.0):
        self.path, self.lease_s = lock_path, lease_s
        self.fs = filesystem(lock_path)
        self.url = str(lock_path)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> bytes:
        return json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                           "expires": time.time() + self.lease_s}).encode()

    def _create(self) -> bool:
        try:
            with self.fs.open(self.url, "xb") as f:
                f.write(self._record())
            return True
        except FileExistsError:
            return False

    def holder(self) -> dict:
        try:
            return json.loads(self.fs.cat_file(self.url))
        except (FileNotFoundError, ValueError):
            return {}

    def acquire(self) -> None:
        if not self._create():
            held = self.holder()
            if held and held.get("expires", 0) > time.time():
                raise LockHeld(f"held by pid {held.get('pid')} on {held.get('host')} "
                               f"(lease renewed until {time.strftime('%H:%M:%S', time.localtime(held['expires']))})")
            self.fs.invalidate_cache()
            try:
                self.fs.rm_file(self.url)  # the lapsed lease of a dead holder
            except FileNotFoundError:
                pass
            if not self._create():
                raise LockHeld(f"taken over by pid {self.holder().get('pid')} just now")
        self._thread = threading.Thread(target=self._renew, name="maxlm-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                with self.fs.open(self.url, "wb") as f:
                    f.write(self._record())
            except OSError:
                pass  # a missed renewal: the next one may succeed before the lease lapses

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            try:
                self.fs.rm_file(self.url)
            except FileNotFoundError:
                pass
