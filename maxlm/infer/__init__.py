"""Using a trained model: ``generate`` samples over the KV cache (``sampling`` picks each token),
``placement`` puts the parameters on an inference mesh; the serving engine joins here. Imports
``maxlm.model`` and ``maxlm.parallel`` (the mesh and logical sharding rules). Opening a checkpoint is ``maxlm.hf.load``; ``python -m maxlm.generate`` is the
command line."""

from maxlm.infer.generate import Generation, PromptError, run
from maxlm.infer.placement import inference_mesh, param_shardings
from maxlm.infer.sampling import SamplingParams

__all__ = ["Generation", "PromptError", "SamplingParams", "inference_mesh", "param_shardings", "run"]
