"""Runtime: runs a rank's program. Knows tasks and values, never strategies."""
