"""Quantize a trained model: ``python -m maxlm.quantize --checkpoint RUN_DIR --method rtn|gptq|awq
--bits 4|8 [--group 128] [--policy all|ffn-only|layered] --out DIR``.

A thin command line over ``maxlm.quant`` (``maxlm/quant/cli.py``): the output DIR is a run
directory that ``maxlm.generate``, ``maxlm.eval`` and ``maxlm.serve`` open like any other.
"""

import sys

from maxlm.quant.cli import main

if __name__ == "__main__":
    sys.exit(main())
