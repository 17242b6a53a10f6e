#!/usr/bin/env bash
# Launch one maxlm training job over several GPU nodes with SLURM: one process per node, each
# driving its node's 8 GPUs; jax.distributed reads the layout from SLURM's environment.
#
#   sbatch --nodes=8 scripts/launch_slurm.sh --config=llama3_8b.gin --run_dir=/shared/runs/llama3_8b
#
# The run directory must be on a filesystem every node sees (checkpoints are written by all
# processes). SLURM sends SIGTERM two minutes before the time limit or on preemption: maxlm saves
# and exits 0, and --requeue starts the job again, which resumes from that checkpoint.
#SBATCH --job-name=maxlm
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --requeue
#SBATCH --signal=TERM@120
#SBATCH --output=maxlm-%j.log
set -euo pipefail
if [ $# -eq 0 ]; then
  echo "usage: sbatch --nodes=N scripts/launch_slurm.sh --config=NAME.gin [--run_dir=DIR] [maxlm.train flags]" >&2
  exit 2
fi
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
srun --kill-on-bad-exit=1 python -m maxlm.train "$@"
