"""No silent CPU on an accelerator host: a cluster that trains on CPU devices says so in one warning where JAX would
use GPUs or TPUs, and says nothing on a CPU-only host. This machine has no accelerator, so the host's devices and
JAX's plugins are patched where a test needs them."""

import warnings

import pytest

import elastic_trainer as et
from elastic_trainer import _private_apis
from elastic_trainer.clusters import _accelerators
from elastic_trainer.clusters._accelerators import accelerator_platform, warn_if_accelerators_unused

SIMULATED_ON_GPUS = (
    "this host has GPUs that JAX would use, but SimulatedCluster (cluster=simulated, the default) trains on "
    'simulated slices of CPU devices; no cluster trains on GPUs yet (docs/clusters.md, "A GPU/NCCL platform layer").'
)
SIMULATED_ON_TPUS = (
    "this host has TPUs that JAX would use, but SimulatedCluster (cluster=simulated, the default) trains on "
    "simulated slices of CPU devices; PathwaysCluster (cluster=pathways) trains on TPU slices through Pathways, "
    "not yet tried on a TPU."
)


@pytest.fixture
def host(monkeypatch):
    """A host whose devices and JAX plugins the test names, with no backend started yet and no JAX_PLATFORMS."""
    monkeypatch.setattr(_accelerators, "backends_started", lambda: False)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)

    def make(hardware: str | None, *, plugin: bool = True):
        monkeypatch.setattr(_accelerators, "accelerator_hardware", lambda: hardware)
        monkeypatch.setattr(_accelerators, "_plugin_installed", lambda platform: plugin and platform == hardware)

    return make


@pytest.mark.parametrize(("hardware", "message"), [("gpu", SIMULATED_ON_GPUS), ("tpu", SIMULATED_ON_TPUS)])
def test_a_simulated_cluster_on_an_accelerator_host_says_so_in_one_warning(host, hardware, message):
    host(hardware)
    cluster = et.SimulatedCluster(slices=2, devices_per_slice=1)
    with pytest.warns(et.AcceleratorUnusedWarning) as caught:
        cluster.configure_jax()
    assert [str(warning.message) for warning in caught] == [message]
    assert [len(devices) for devices in cluster.slice_devices()] == [1, 1]  # and it trains on CPU devices still


def test_the_multiprocess_cluster_on_cpu_names_the_default_platform_option():
    with pytest.warns(et.AcceleratorUnusedWarning) as caught:
        warn_if_accelerators_unused("multiprocess", "gpu")
    assert [str(warning.message) for warning in caught] == [
        'this host has GPUs that JAX would use, but MultiprocessCluster(platform="cpu") (cluster.platform=cpu, the '
        "default) trains on CPU devices; platform=None (cluster.platform=null) takes JAX's default platform, not yet "
        'tried on GPUs: no GPU platform layer is written yet (docs/clusters.md, "A GPU/NCCL platform layer").'
    ]


def test_the_warning_is_one_users_can_filter():
    assert issubclass(et.AcceleratorUnusedWarning, UserWarning)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", et.AcceleratorUnusedWarning)
        warn_if_accelerators_unused("simulated", "gpu")  # filterwarnings=error would raise it if it were not filtered


@pytest.mark.parametrize(("hardware", "plugin", "jax_platforms", "expected"), [
    ("gpu", True, None, "gpu"),
    ("tpu", True, None, "tpu"),
    ("gpu", True, "cuda,cpu", "gpu"),
    ("gpu", True, "cpu", None),  # the user chose CPU: JAX's default backend is CPU
    ("tpu", True, "cpu", None),
    ("gpu", False, None, None),  # no CUDA plugin: JAX falls back to CPU itself
    ("tpu", False, None, None),  # no libtpu
    (None, True, None, None),
])
def test_the_accelerator_is_found_before_any_backend_starts(host, monkeypatch, hardware, plugin, jax_platforms,
                                                            expected):
    host(hardware, plugin=plugin)
    if jax_platforms is not None:
        monkeypatch.setenv("JAX_PLATFORMS", jax_platforms)
    assert accelerator_platform() == expected


@pytest.mark.parametrize(("backend", "expected"), [("gpu", "gpu"), ("tpu", "tpu"), ("cpu", None)])
def test_a_running_backend_answers_for_itself(monkeypatch, backend, expected):
    monkeypatch.setattr(_accelerators, "backends_started", lambda: True)
    monkeypatch.setattr(_accelerators.jax, "default_backend", lambda: backend)
    assert accelerator_platform() == expected


def test_a_cpu_only_host_gets_no_warning(monkeypatch):
    if _private_apis.accelerator_hardware() is not None:
        pytest.skip("this host has an accelerator")
    monkeypatch.setattr(_accelerators, "backends_started", lambda: False)  # the probes a fresh process runs
    assert accelerator_platform() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error", et.AcceleratorUnusedWarning)
        et.SimulatedCluster(slices=2, devices_per_slice=1).configure_jax()
