#!/bin/sh
# PID 1 of uml_kernel.py's probe guest: a shell running at all shows the kernel can run processes
# on this CPU (a 6.1 or 6.12 UML guest on some hosts panics as its first process starts).
echo "netem-probe: up $(uname -r)"
poweroff -f
