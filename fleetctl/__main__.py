"""`python -m fleetctl ...` is the `fleet` command (how the parts start each other)."""

from fleetctl.cli import main

main()
