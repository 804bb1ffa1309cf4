"""`testbed feasibility`: which link rates and distances a deployment survives, by the model and
checked by simulation, with its report."""
