"""Planning a run before renting it: ``python -m maxlm.plan`` (``planner``) works out parameters,
FLOPs, per-device memory (``memory``), step time, GPU-hours and cost from a config alone, and with
``--aot`` compiles the real train step on fake CPU devices. The planner takes its facts from the
packages that own them: FLOPs from ``maxlm.model.flops``, parameter shapes from
``maxlm.model.abstract_params``, shardings from ``maxlm.rules`` and ``maxlm.train.step``, mesh
divisibility from ``maxlm.config.mesh_problem``, the pipeline's bubble and schedule from
``maxlm.parallel.pipeline_parallel``. Importing this package starts no jax (``--aot`` sets
XLA_FLAGS first).
"""

from maxlm.plan.planner import main

__all__ = ["main"]
