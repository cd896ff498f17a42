"""``MeshShape``: the one value of a run's parallel degrees, against the jax mesh it makes."""

import jax
import pytest

from megajax.errors import ShardingConfigError
from megajax.parallel.mesh import MeshShape


def test_the_shape_resolves_names_and_makes_its_mesh():
    shape = MeshShape(-1, 2, pipe=2, context=2).resolved(8)
    assert shape == MeshShape(1, 2, pipe=2, context=2) and shape.devices == 8 and shape.batch_shards == 1
    assert shape.axes == ("pipe", "data", "context", "model")
    assert shape.spelling == "2x1x2 (pipe x data x model),context=2"
    mesh = shape.make()
    assert mesh.axis_names == shape.axes and dict(mesh.shape) == shape.sizes
    experts = MeshShape(2, 1, expert=2)
    assert experts.axes == ("data", "expert", "model") and experts.batch_shards == 4 and experts.devices == 4
    assert experts.make().devices.size == 4 and MeshShape().axes == ("data", "model")


@pytest.mark.parametrize("degrees, message", [
    (dict(data=0), "mesh.data must be a whole number >= 1 or -1 (all the devices left), got 0"),
    (dict(expert=0), "mesh.expert must be a whole number >= 1 (1: no expert parallelism), got 0: set E in "
                     "--mesh=DATAxMODEL,expert=E"),
    (dict(model=True), "mesh.model must be a whole number >= 1, got True"),
])
def test_a_degree_below_one_is_refused_where_it_is_made(degrees, message):
    with pytest.raises(ShardingConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        MeshShape(**degrees)


def test_a_mesh_the_devices_cannot_hold_says_what_to_change():
    with pytest.raises(ShardingConfigError, match=r"mesh 4x4 needs 16 devices but 8 are present"):
        MeshShape(4, 4).resolved(jax.device_count())
    with pytest.raises(ShardingConfigError, match=r"mesh.pipe=3 x mesh.model=1 does not divide the 8 devices"):
        MeshShape(-1, 1, pipe=3).resolved(8)
