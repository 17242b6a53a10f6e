"""Where ``maxlm.hf import`` writes, and how RUN_DIR/params and RUN_DIR/config.gin appear: whole, or
not at all.

Both are built in a hidden temporary sibling of RUN_DIR, ``.NAME.hf-import.tmp-PID`` (same
filesystem, so renames are atomic), and renamed into place only when complete. A new RUN_DIR is one
rename. Into an existing RUN_DIR, ``params`` goes first and ``config.gin`` last, so a config.gin
always points at complete parameters (a kill between those two renames leaves params without a
config.gin, which the next import names and refuses to overwrite). A killed import leaves only its
hidden temporary, which nothing reads; the next import for the same RUN_DIR removes it once the
process that made it is gone.

Nothing that was there before is overwritten or deleted: existing params or config.gin are refused,
and an --out that is, contains or lies inside HF_DIR is refused.

``maxlm.hf export`` publishes a whole directory the same way (``staged_dir``): it is built in
``.NAME.hf-export.tmp-PID`` and renamed onto --out (absent or empty) only once every file and the
manifest are written, so an interrupted export never leaves a directory that looks complete.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from maxlm import storage

from maxlm.data.atomic import pid_alive  # one liveness check for every staged output
from maxlm.hf.hf_config import HFExportError, HFImportError

OUTPUTS = ("params", "config.gin")  # publishing order: config.gin last marks the import complete


def _real(path: str | Path) -> Path:
    return Path(os.path.realpath(Path(path).expanduser()))


def _never_overwrite(path: Path) -> None:
    if os.path.lexists(path):
        raise HFImportError(f"{path}: already exists; maxlm.hf never overwrites (choose another --out)")


def check_out(hf_dir: str | Path, out: str | Path) -> Path:
    """The real path of RUN_DIR, after refusing (one line each) every --out an import must not
    write to: HF_DIR itself, above or inside it, a file, below a file, or holding earlier outputs.
    A bucket RUN_DIR must hold no earlier outputs."""
    if storage.is_remote(out):
        remote = storage.path(out)
        for name in OUTPUTS:
            if (remote / name).exists():
                raise HFImportError(f"{remote / name}: already exists; maxlm.hf never overwrites (choose another --out)")
        return remote
    run_dir, source = _real(out), _real(hf_dir)
    relation = ("is" if run_dir == source else "lies inside" if source in run_dir.parents
                else "contains" if run_dir in source.parents else "")
    if relation:
        raise HFImportError(f"--out {out} {relation} HF_DIR {hf_dir}; writing there could mix the "
                            "import into its own input, so choose an --out outside it")
    if os.path.lexists(run_dir) and not run_dir.is_dir():
        raise HFImportError(f"{run_dir}: exists and is not a directory; --out must be a new or "
                            "existing directory (choose another --out)")
    ancestor = run_dir.parent
    while not os.path.lexists(ancestor):
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise HFImportError(f"{ancestor}: not a directory, so --out {out} cannot be created")
    for name in OUTPUTS:
        _never_overwrite(run_dir / name)
    return run_dir


def _clear_dead_stages(run_dir: Path, verb: str = "import", error: type[ValueError] = HFImportError) -> None:
    """Remove what killed imports (exports) into ``run_dir`` left; refuse while another is writing."""
    pattern = re.compile(rf"\.{re.escape(run_dir.name)}\.hf-{verb}\.tmp-(\d+)")
    if not run_dir.parent.is_dir():
        return
    for entry in sorted(run_dir.parent.iterdir()):
        match = pattern.fullmatch(entry.name)
        if not match:
            continue
        pid = int(match.group(1))
        if pid != os.getpid() and pid_alive(pid):
            raise error(f"another maxlm.hf {verb} (pid {pid}) is writing {run_dir} now ({entry}); "
                        f"wait for it, or remove {entry} if that process is not an {verb}")
        shutil.rmtree(entry, ignore_errors=True)


def _publish(stage: Path, run_dir: Path) -> None:
    if not os.path.lexists(run_dir):
        os.rename(stage, run_dir)  # one step: RUN_DIR appears complete or not at all
        return
    moved: list[str] = []
    try:
        for name in OUTPUTS:
            _never_overwrite(run_dir / name)  # again: another process may have written meanwhile
            os.rename(stage / name, run_dir / name)
            moved.append(name)
    except BaseException:
        for name in moved:  # undo, so that no half of an import is left in RUN_DIR
            os.rename(run_dir / name, stage / name)
        raise


@contextlib.contextmanager
def _staging(target: Path, verb: str, error: type[ValueError], publish: Callable[[Path], None],
             nothing: str) -> Iterator[Path]:
    """A fresh hidden sibling of ``target`` to write into, handed to ``publish`` when the block
    completes. On any failure it is removed, with the parent directories this made, and an OSError
    becomes one line (``error``) ending "nothing was {nothing}"."""
    _clear_dead_stages(target, verb, error)
    made = [p for p in (target.parent, *target.parent.parents) if not os.path.lexists(p)]
    stage = target.parent / f".{target.name}.hf-{verb}.tmp-{os.getpid()}"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        stage.mkdir()
        yield stage
        publish(stage)
    except OSError as err:
        where = err.filename or target
        raise error(f"{where}: {err.strerror or err}; nothing was {nothing}") from None
    finally:
        if os.path.lexists(stage):
            shutil.rmtree(stage, ignore_errors=True)
        for path in made:  # deepest first; only the empty ones, so nothing else is ever removed
            with contextlib.suppress(OSError):
                path.rmdir()


@contextlib.contextmanager
def _uploaded(target, error: type[ValueError], last: str) -> Iterator[Path]:
    """A local temporary folder, uploaded to the bucket ``target`` when the block completes, the
    file ``last`` (what readers check first) last; an upload failure is one line (``error``)."""
    with tempfile.TemporaryDirectory(prefix="maxlm-hf-") as stage:
        yield Path(stage)
        try:
            storage.upload_tree(stage, target, last=last)
        except Exception as err:  # noqa: BLE001 - fsspec, botocore and google errors
            raise error(f"{target}: upload failed ({type(err).__name__}: {' '.join(str(err).split())[:200]}); "
                        f"without {last} the upload is incomplete and unused") from None


@contextlib.contextmanager
def staged(run_dir: Path) -> Iterator[Path]:
    """A fresh hidden directory beside ``run_dir`` to write OUTPUTS into. They are published into
    ``run_dir`` when the block completes; on any failure nothing is left (``_staging``)."""
    def publish(stage: Path) -> None:
        missing = [name for name in OUTPUTS if not (stage / name).exists()]
        if missing:  # a guard against bugs: never publish an incomplete import
            raise RuntimeError(f"internal error: the import did not write {missing}")
        _publish(stage, run_dir)

    if storage.is_remote(run_dir):
        with _uploaded(run_dir, HFImportError, last=OUTPUTS[-1]) as stage:
            yield stage
        return
    with _staging(run_dir, "import", HFImportError, publish, f"imported into {run_dir}") as stage:
        yield stage


# ---------------------------------------------------------------------------------------------
# maxlm.hf export: one directory, published by one rename


def check_export_out(out: str | Path) -> Path:
    """The real path of an export's --out, after refusing (one line each) a file, a path below a
    file, and a non-empty directory (an export never merges into or overwrites anything). An --out
    in a bucket must hold nothing yet."""
    if storage.is_remote(out):
        remote = storage.path(out)
        if remote.exists():
            raise HFExportError(f"--out {out}: already exists in the bucket; maxlm.hf export never "
                                "overwrites (choose a new directory)")
        return remote
    path = _real(out)
    if os.path.lexists(path):
        if not path.is_dir():
            raise HFExportError(f"--out {out}: exists and is not a directory (choose a new directory)")
        if any(path.iterdir()):
            raise HFExportError(f"--out {out}: directory exists and is not empty; maxlm.hf export never "
                                "overwrites (choose a new directory or remove this one)")
    ancestor = path.parent
    while not os.path.lexists(ancestor):
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise HFExportError(f"{ancestor}: not a directory, so --out {out} cannot be created")
    return path


@contextlib.contextmanager
def staged_dir(out: Path) -> Iterator[Path]:
    """A fresh hidden sibling of ``out`` to write an export into, renamed onto ``out`` (absent or
    an empty directory) when the block completes; on any failure nothing is left (``_staging``)."""
    def publish(stage: Path) -> None:
        os.rename(stage, out)  # atomic; fails (ENOTEMPTY) if --out was filled meanwhile

    if storage.is_remote(out):
        with _uploaded(out, HFExportError, last="config.json") as stage:
            yield stage
        return
    with _staging(out, "export", HFExportError, publish, f"exported to {out}") as stage:
        yield stage
