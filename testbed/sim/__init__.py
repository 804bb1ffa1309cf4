"""The discrete-event driver of the core in virtual (paper) time. May import core, config,
model, traces and metrics; never deploy, studies or cli.

`simulate(resolved_scenario, trace, run_dir)` replays a trace through the same core code the
live services run and writes the records, time series and decisions a live run writes; the
link model is in `testbed.sim.network` and `testbed.sim.tcp`.
"""

from testbed.sim.simulator import SimOptions, SimStats, Simulation, shaping, simulate

__all__ = ["SimOptions", "SimStats", "Simulation", "shaping", "simulate"]
