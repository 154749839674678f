"""inmem_ft: in-memory, erasure-coded snapshots of training state."""
