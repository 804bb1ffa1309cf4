"""The experiments, one package each (crosscheck, capacity, feasibility, plan, sweep, bench,
linkcheck), built on the run base (`testbed.run`), each with its command registration. May import
every layer but `cli`; nothing below imports it."""
