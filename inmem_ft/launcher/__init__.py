"""Run jobs on simulated nodes of one machine, inject failures, supervise restarts, report a timeline."""
