"""The discrete-event driver of the core in virtual (paper) time. May import core, config,
model, traces and metrics; never deploy, studies or cli."""
