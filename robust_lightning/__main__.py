import sys

from robust_lightning.cli import main

sys.exit(main())
