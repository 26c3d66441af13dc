"""`python -m tokenfleet.cli` (how tests and local fleets start worker processes)."""

from tokenfleet.cli import main

main()
