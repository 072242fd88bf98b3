"""Pure planning: topology, and which samples every (rank, worker) reads in an epoch."""
