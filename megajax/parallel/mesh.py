"""The device mesh's shape: one frozen value for every parallel degree of a run.

``MeshShape`` holds the five degrees (``pipe``, ``data``, ``expert``, ``context``, ``model``) and everything that
follows from them alone: the device count, the batch's shards, the axis names in order, the spelling ``--mesh`` uses,
the one validity check and the ``jax.sharding.Mesh`` itself. A run's devices and batch shards are read from here (the
tools' cost formulas, given degrees as numbers, multiply those a group's size needs); a new axis is a field here,
its rule in ``config.run.rules_for`` and its mechanism's own module.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from megajax.errors import ShardingConfigError
from megajax.parallel.sharding import CONTEXT_AXIS, EXPERT_AXIS, MODEL_AXIS, PIPE_AXIS

DATA_AXIS = "data"
# the axes outermost first: `pipe` may span hosts, `model` stays the innermost (fastest) axis
ORDER = (PIPE_AXIS, DATA_AXIS, EXPERT_AXIS, CONTEXT_AXIS, MODEL_AXIS)
# what a degree of 1 means, for the messages (data and model always have an axis)
_ONE_MEANS = {PIPE_AXIS: "no pipeline", EXPERT_AXIS: "no expert parallelism", CONTEXT_AXIS: "no context parallelism"}
_SPELLED = {DATA_AXIS: "DATA in --mesh=DATAxMODEL", MODEL_AXIS: "MODEL in --mesh=DATAxMODEL",
            PIPE_AXIS: "PIPE in --mesh=PIPExDATAxMODEL"}


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """The parallel degrees of a run. ``data=-1`` (as the config may say) means every device the other axes leave:
    ``resolved(devices)`` fixes it. Constructing one checks every degree is a whole number >= 1 (ShardingConfigError
    naming the degree and its ``--mesh`` spelling), before anything divides by one."""

    data: int = 1
    model: int = 1
    pipe: int = 1
    expert: int = 1  # a mixture of experts' experts split over it, and outside the routed layers the batch
    context: int = 1  # every sequence split over it

    def __post_init__(self) -> None:
        for name in ORDER:
            value = getattr(self, name)
            whole = isinstance(value, int) and not isinstance(value, bool)
            if not (whole and (value >= 1 or name == DATA_AXIS and value == -1)):
                extra = " or -1 (all the devices left)" if name == DATA_AXIS else \
                    f" (1: {_ONE_MEANS[name]})" if name in _ONE_MEANS else ""
                spelled = _SPELLED.get(name, f"E in --mesh=DATAxMODEL,{name}=E")
                raise ShardingConfigError(f"mesh.{name} must be a whole number >= 1{extra}, got {value!r}: set "
                                          f"{spelled} (or --config.mesh.{name})")

    @classmethod
    def of(cls, section: Mapping[str, Any]) -> MeshShape:
        """A config's ``mesh`` section (``config.mesh``) as a MeshShape."""
        return cls(**{name: section[name] for name in ORDER})

    @property
    def sizes(self) -> dict[str, int]:
        """Each axis of the mesh and its size, outermost first (``axes``); ``data`` must be resolved."""
        return {a: getattr(self, a) for a in self.axes}

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh's axis names: ('data', 'model'), with 'pipe' first where there are stages, 'expert' after 'data'
        where experts are split and 'context' just outside 'model' where sequences are (an axis of size 1 is left
        out, so such a mesh compiles as it did without)."""
        return tuple(a for a in ORDER if a in (DATA_AXIS, MODEL_AXIS) or getattr(self, a) > 1)

    @property
    def devices(self) -> int:
        """The devices the mesh spans (``data`` resolved)."""
        self._require_resolved()
        return math.prod(getattr(self, a) for a in ORDER)

    @property
    def batch_shards(self) -> int:
        """The shards of the batch outside the pipeline's stages: data x expert (the expert shards are data shards
        outside the routed layers)."""
        self._require_resolved()
        return self.data * self.expert

    @property
    def others(self) -> int:
        """The devices each data shard spans: pipe x expert x context x model."""
        return self.pipe * self.expert * self.context * self.model

    @property
    def spelling(self) -> str:
        """The mesh as ``--mesh`` spells it, the stages named: DATAxMODEL, PIPExDATAxMODEL (pipe x data x model)
        with stages, ``,expert=E`` with experts split, ``,context=C`` with sequences split."""
        named = " (pipe x data x model)" if self.pipe > 1 else ""
        return self._shape + named + self._suffixes

    @property
    def flag(self) -> str:
        """The value of ``--mesh`` that gives this shape (train.py, megajax.info, megajax.scaling)."""
        return self._shape + self._suffixes

    @property
    def _shape(self) -> str:
        return f"{self.pipe}x{self.data}x{self.model}" if self.pipe > 1 else f"{self.data}x{self.model}"

    @property
    def _suffixes(self) -> str:
        return (f",expert={self.expert}" if self.expert > 1 else "") + \
            (f",context={self.context}" if self.context > 1 else "")

    def replace(self, **degrees: int) -> MeshShape:
        """This shape with some degrees changed (checked as any)."""
        return dataclasses.replace(self, **degrees)

    def resolved(self, num_devices: int) -> MeshShape:
        """This shape with ``data=-1`` made the devices left after the other axes, checked against ``num_devices``;
        ShardingConfigError naming the whole mesh as ``--mesh`` spells it."""
        shape = self
        if self.data == -1:
            if num_devices % self.others:
                axes = " x ".join(f"mesh.{n}={getattr(self, n)}" for n in ORDER
                                  if n != DATA_AXIS and (getattr(self, n) > 1 or n == MODEL_AXIS))
                raise ShardingConfigError(f"{axes} does not divide the {num_devices} devices present; set mesh.data, "
                                          "or pick sizes whose product divides them")
            shape = self.replace(data=num_devices // self.others)
        if shape.devices > num_devices:
            raise ShardingConfigError(f"mesh {shape.spelling} needs {shape.devices} devices but {num_devices} are "
                                      "present; lower a mesh size (on a CPU host, --cpu_devices simulates more)")
        return shape

    def make(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
        """The ``jax.sharding.Mesh`` over the first of ``devices`` (default: this host's), ``data=-1`` resolved.

        Axes are ``Auto``: XLA's SPMD partitioner propagates shardings from the parameters and the few activations
        we pin, which is how Megatron's f/g all-reduces appear without hand-written collectives."""
        devices = list(jax.devices() if devices is None else devices)
        shape = self.resolved(len(devices))
        sizes = tuple(shape.sizes.values())
        grid = np.asarray(devices[: math.prod(sizes)]).reshape(sizes)
        return Mesh(grid, shape.axes, axis_types=(AxisType.Auto,) * len(sizes))

    def _require_resolved(self) -> None:
        if self.data == -1:
            raise ValueError("mesh.data=-1 is resolved against the devices first (MeshShape.resolved)")
