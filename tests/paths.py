"""Where the tests' files are: the test folders are by weight (pure, store, processes, engines,
containers, simulation); the configs and harnesses they share sit here at the top."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
