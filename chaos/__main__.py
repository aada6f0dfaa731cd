"""python -m chaos run [--scenarios NAME,...|all] [--requests N] [--concurrency C] [--seed S] [--json]"""

import sys

from chaos.cli import main

sys.exit(main())
