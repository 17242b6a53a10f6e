"""maxlm: a JAX/XLA stack that takes a language model from plan to serving."""

__version__ = "0.1.0"
