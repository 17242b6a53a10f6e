import sys

from maxlm.plan.planner import main

sys.exit(main())
