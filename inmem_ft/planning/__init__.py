"""Planning: what interval, EC group, parity and memory a job needs, and what that buys in effective training time.

- `inputs`: the cluster, the job, the failure model and our costs, with built-in defaults and their sources;
  costs can be read from the benchmarks' result files.
- `simulate`: a seeded discrete-event simulation of a long run under failures, for in-memory snapshots, disk
  checkpoints and full in-memory replication.
- `plan`: the recommendation (Young/Daly interval, G and m from `planning.survival`, disk-tier cadence,
  memory per node) and the config block it amounts to.
- `command`: `inmem-ft plan`.
"""
