"""`python -m ecoserve ...` works like the `ecoserve` command."""
import sys

from ecoserve.cli import main

sys.exit(main())
