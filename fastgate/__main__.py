import sys

from fastgate.entrypoints.cli import main

sys.exit(main())
