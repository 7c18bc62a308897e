import sys

from fastgate.cli import main

sys.exit(main())
