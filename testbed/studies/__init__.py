"""The experiments, built from the layers below: one replay run (`runner`), `replay`/`up`,
capacity search, the paper's Table 6 study, sweeps, benchmarks and linkcheck, each with its
command registration. May import every layer but `cli`; nothing below imports it."""
