"""Parallelism: the device mesh and shardings (``sharding``, driven by ``maxlm.rules``), pipeline
parallelism as a layer-stack runner the step builder injects into the model
(``pipeline_parallel``), and multi-process start-up (``distributed``). Imports only ``maxlm.config``
and ``maxlm.rules``; the model imports ``sharding.constrain`` from here."""
