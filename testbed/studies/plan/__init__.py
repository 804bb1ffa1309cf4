"""`testbed plan`: the deployment planner's grid for a trace, its report and the simulated check."""
