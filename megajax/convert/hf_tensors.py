"""An HF state dict read tensor by tensor (each checked against the shape its config implies), for the HF converters."""

from __future__ import annotations

import numpy as np


class HFTensors:
    """``take`` returns a tensor as fp32 after checking its shape; ``rest`` is what was never taken, which a
    converter must account for (buffers, tied copies) or refuse."""

    def __init__(self, sd: dict[str, np.ndarray], sizes: str, classes: str):
        self.sd, self.sizes, self.classes = sd, sizes, classes  # sizes: config.json's fields, for messages
        self.used: set[str] = set()

    def take(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.sd:
            raise KeyError(f"the HF weights have no tensor {name!r}: give a {self.classes} directory whose "
                           "config.json model_type matches its weights")
        a = self.sd[name]
        if tuple(a.shape) != shape:
            raise ValueError(f"HF tensor {name} is {tuple(a.shape)}, but config.json ({self.sizes}) implies {shape}")
        self.used.add(name)
        return np.asarray(a, np.float32)

    def rest(self, tied: dict[str, str], what: str) -> set[str]:
        """The tensors never taken, less each ``tied`` copy (copy -> source) after checking it equals its source;
        ``what``: the message's reason the two must be equal."""
        rest = set(self.sd) - self.used
        for copy, source in tied.items():
            if copy in rest:
                if not np.array_equal(self.sd[copy], self.sd[source]):
                    raise ValueError(f"the HF weights hold a {copy} that differs from {source}: {what}")
                rest.discard(copy)
        return rest
