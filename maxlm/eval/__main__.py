import sys

from maxlm.eval.cli import main

sys.exit(main())
