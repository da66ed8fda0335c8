"""qtool: turn huge MoE checkpoints into serving-ready, verified artifacts."""

__version__ = "0.1.0"
