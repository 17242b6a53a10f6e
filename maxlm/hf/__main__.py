import sys

from maxlm.hf.cli import main

sys.exit(main())
