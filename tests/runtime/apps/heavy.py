"""A module the forking app imports by reference (so every process that loads the app imports it): torch, and the
pid of the process that imported it."""
import os

import torch  # noqa: F401  the import a fork server saves every replica after the first

IMPORTED_IN = os.getpid()
