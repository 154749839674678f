"""Run jobs on simulated nodes of one machine, inject failures, supervise restarts (warm standby workers take
over restarted ranks), report a timeline and the time each failure cost, part by part."""
