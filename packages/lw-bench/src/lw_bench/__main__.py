import sys

from lw_bench.cli import main

sys.exit(main())
