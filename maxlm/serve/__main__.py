"""``python -m maxlm.serve``: see ``maxlm.serve.cli``."""

import sys

from maxlm.serve.cli import main

sys.exit(main())
