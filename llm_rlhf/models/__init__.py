"""Models, reward models, reward functions, the scorer and the judges; device and sharding plumbing.
Imports `core` and `rl`."""
