"""The private JAX and Orbax APIs of elastic_trainer/_private_apis.py are there, shaped as the package uses them."""

import dataclasses
import re
from pathlib import Path

import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest

from elastic_trainer import _private_apis
from elastic_trainer._private_apis import PRIVATE_APIS, PrivateApiChanged

PACKAGE = Path(_private_apis.__file__).parent
PLUGINS = PACKAGE.parent / "plugins"


@pytest.mark.parametrize("api", PRIVATE_APIS, ids=[api.path for api in PRIVATE_APIS])
def test_each_private_api_is_there_as_the_package_uses_it(api):
    api.check()


@pytest.mark.parametrize(("change", "detail"), [
    (dict(path="jax._src.xla_bridge:no_such_function"), "it is not there"),
    (dict(parameters=("address", "no_such_parameter")), "it takes no parameter no_such_parameter"),
    (dict(attributes=("no_such_attribute",)), "it has no attribute no_such_attribute"),
])
def test_a_changed_api_is_named_with_the_versions_it_was_written_for(change, detail):
    changed = dataclasses.replace(_private_apis.COORDINATION_CLIENT, **change)
    with pytest.raises(PrivateApiChanged) as error:
        changed.check()
    message = str(error.value)
    assert message.startswith(f"{changed.path} (used for {changed.used_for}; written for {_private_apis.WRITTEN_FOR})")
    assert f": {detail}" in message and message.endswith(".")


def test_an_instance_attribute_that_is_gone_is_named():
    changed = dataclasses.replace(_private_apis.ORBAX_NUMPY_METADATA_KEY, instance_attributes=("_gone",))
    with pytest.raises(PrivateApiChanged, match="its instances have no attribute _gone"):
        changed.check()


def test_no_other_module_reaches_into_jax_or_orbax_internals():
    private = re.compile(r"jax\._src|orbax\.checkpoint\._src|_DEFAULT_BARRIER_TIMEOUT|\._open_and_write|\._metadata_key|_wait_for_checkpointers|_async_manager|_commit_futures")
    offenders = [f"{path}:{number}" for directory in (PACKAGE, PLUGINS) for path in sorted(directory.rglob("*.py"))
                 if path.name != "_private_apis.py"
                 for number, line in enumerate(path.read_text().splitlines(), 1) if private.search(line)]
    assert offenders == []


def test_the_writes_of_an_asynchronous_save_are_found(tmp_path):
    # the instance attributes save_writes reads (ORBAX_SAVE_WRITES) exist only on a manager that saved
    manager = ocp.CheckpointManager(tmp_path, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True))
    manager.save(1, args=ocp.args.StandardSave({"x": jnp.arange(4.0)}))
    writes = _private_apis.save_writes(manager)
    manager.wait_until_finished()
    assert writes and all(callable(write.result) for write in writes)
    assert manager.all_steps() == [1]
    manager.close()
