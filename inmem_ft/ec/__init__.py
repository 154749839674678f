"""Reed-Solomon erasure coding (Intel ISA-L) on in-memory buffers, and the stripe layout over a node group."""
