import sys

from gateway.programs.cli import main

sys.exit(main())
