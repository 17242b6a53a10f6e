"""Using a trained model: sampling over the KV cache (``generate``); the serving engine joins here.
Imports ``maxlm.model``."""
