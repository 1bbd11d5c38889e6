import sys

from lightning_twobp.bench.cli import main

sys.exit(main())
