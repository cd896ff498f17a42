"""megajax: Megatron-LM's tensor + data parallelism in JAX/Flax NNX."""

__version__ = "0.1.0"
