"""The parallel primitives every model is built from: logical axis names and the rules that map them onto the
``(data, model)`` mesh (``sharding.py``), parameter layouts and sharded initialisation (``partition.py``), the
tensor-parallel layers (``layers.py``), the vocab-parallel cross-entropy (``losses.py``), activation
recomputation's policies (``remat.py``), and reading a compiled step's collectives (``hlo_audit.py``). Imports jax
and flax only."""
