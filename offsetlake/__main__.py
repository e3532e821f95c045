import sys

from offsetlake.cli import main

sys.exit(main())
