"""`testbed bench`: benchmarks of the simulator, the live path and the peer mocker."""
