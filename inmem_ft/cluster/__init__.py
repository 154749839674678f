"""Which nodes form EC groups, how they talk, and how likely a snapshot is to survive."""
