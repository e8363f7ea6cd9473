import os

# OpenMP's threads spin while they wait for each other: on a machine with more busy processes than cores, a
# two-thread torch job waits a scheduler slice on each of its thousands of small ops (the tiny Kimi's fit: 47 s a
# step, 90 steps, against 0.66 s passive at a load of 14 on 2 cores). Every test, and every job a test runs, waits
# passively, as `make test` sets it; read when a process loads torch, so set before any test imports it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
