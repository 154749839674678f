"""The per-node snapshot management process (SMP), its client and its control helpers."""
