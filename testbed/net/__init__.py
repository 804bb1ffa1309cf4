"""Network emulation: topology as data, a plan of operations, one pyroute2 executor, link
shaping, the userspace delay line, link monitors, service processes and idempotent teardown.
May import core, config, model, traces, metrics and live; never deploy, studies or cli."""
