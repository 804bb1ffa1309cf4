"""Per-request records, time series, summaries, reports and plots, comparison and regression
gates. May import core and config; never live, net, sim, deploy or studies."""
