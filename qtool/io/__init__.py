"""Checkpoint IO: safetensors headers without data, lazy reads, byte-range shard writing, config files."""
