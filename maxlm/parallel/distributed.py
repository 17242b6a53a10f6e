"""Many hosts, one job: JAX's own distributed runtime, started from flags or the environment.

Every process runs the same program. ``initialize`` must run before anything touches a device.
With explicit flags (or the ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``
environment variables our launchers set) it calls ``jax.distributed.initialize`` with them; inside
a SLURM or Open MPI job of several tasks it lets JAX detect the cluster itself. CPU processes talk
through gloo, so the same code runs a multi-process job on one laptop.
"""

from __future__ import annotations

import argparse
import os


class DistributedError(ValueError):
    """Inconsistent multi-process settings (the message is one line)."""


def add_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("multi-process (see README: Running on many hosts)")
    group.add_argument("--coordinator_address", default=os.environ.get("JAX_COORDINATOR_ADDRESS"),
                       help="host:port of process 0 (env JAX_COORDINATOR_ADDRESS)")
    group.add_argument("--num_processes", type=int, default=_env_int("JAX_NUM_PROCESSES"),
                       help="processes in the job (env JAX_NUM_PROCESSES)")
    group.add_argument("--process_id", type=int, default=_env_int("JAX_PROCESS_ID"),
                       help="this process's index (env JAX_PROCESS_ID)")


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def _cluster_detected() -> bool:
    """A scheduler JAX can read the layout from (SLURM, Open MPI) with more than one task."""
    for name in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if int(os.environ.get(name, "1") or 1) > 1:
            return True
    return False


def initialize(args: argparse.Namespace) -> None:
    """Start jax.distributed when this is a multi-process job; a no-op for a single process."""
    explicit = (args.coordinator_address, args.num_processes, args.process_id)
    if all(v is None for v in explicit) and not _cluster_detected():
        return
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # only used by CPU devices
    if all(v is None for v in explicit):
        jax.distributed.initialize()
        return
    if None in explicit:
        raise DistributedError(
            "multi-process runs need --coordinator_address, --num_processes and --process_id together; got "
            f"coordinator_address={args.coordinator_address}, num_processes={args.num_processes}, "
            f"process_id={args.process_id}")
    if not 0 <= args.process_id < args.num_processes:
        raise DistributedError(f"--process_id={args.process_id} must lie in [0, --num_processes={args.num_processes})")
    jax.distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
