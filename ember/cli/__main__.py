"""`python -m ember.cli`: the same as the `ember` script."""
import sys

from ember.cli import main

sys.exit(main())
