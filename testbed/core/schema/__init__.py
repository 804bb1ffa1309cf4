"""The scenario schema and what is defined with it: link profiles, node topology, the exhaustive
kinds, request limits, paper/wire scaling and the live path's parameters."""
