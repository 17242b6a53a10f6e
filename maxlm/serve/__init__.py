"""Serving: ``python -m maxlm.serve`` answers the OpenAI API from a checkpoint, with continuous
batching over a paged KV cache. ``engine`` schedules and runs requests, ``paged_cache`` is the
cache layout the model writes through, ``blocks`` keeps the pool's free list, reference counts
and prefix cache, ``api`` is the HTTP layer (FastAPI), ``metrics`` the Prometheus gauges."""

from maxlm.serve.engine import Engine, EngineConfig, Output, RequestParams

__all__ = ["Engine", "EngineConfig", "Output", "RequestParams"]
