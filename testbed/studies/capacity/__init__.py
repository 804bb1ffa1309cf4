"""`testbed capacity`: the highest rate a deployment serves within its SLO, and the paper's
Table 6 study built from it."""
