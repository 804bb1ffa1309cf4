"""The paper's analytical throughput model and its optimiser (threshold t, N_p/N_d split).
May import core and config; never live, net, sim, deploy or studies."""
