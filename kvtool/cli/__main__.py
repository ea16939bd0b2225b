import sys

from kvtool.cli import main

sys.exit(main())
