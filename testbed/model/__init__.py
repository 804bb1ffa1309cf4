"""The paper's analytical throughput model, its optimiser (threshold t, N_p/N_d split), a trace's
workload as the model reads it, and the deployment planner. May import core, config and traces;
never live, net, sim, deploy or studies."""
