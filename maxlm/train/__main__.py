import sys

from maxlm.train.pretrain import main

sys.exit(main())
