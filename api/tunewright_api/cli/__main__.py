import sys

from tunewright_api.cli import main

sys.exit(main())
