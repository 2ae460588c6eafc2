import sys

from magicdec.cli import main

sys.exit(main())
