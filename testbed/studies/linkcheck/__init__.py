"""`testbed linkcheck`: one shaped link measured against its profile."""
