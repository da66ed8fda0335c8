"""One module per operation; each has a pure plan step and a run step."""
