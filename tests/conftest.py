"""Shared fixtures: 8 CPU devices, no entry-point autoloading, a tiny workload, one compilation cache, code
generated at -O0."""

import os
import shutil
import subprocess
import sys
import tempfile

os.environ["ELASTIC_TRAINER_DISABLE_PLUGIN_AUTOLOAD"] = "1"
# The suite trains on CPU devices everywhere; on a host with an accelerator (a GPU machine) the CPU clusters would
# warn that it goes unused (AcceleratorUnusedWarning), which filterwarnings=error makes every such test fail. Choosing
# CPU is what that warning tells a user to do; tests/test_accelerators.py unsets it for its own cases.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Python caches compiled modules (__pycache__) here and in every process a test starts, even where the environment
# says not to (PYTHONDONTWRITEBYTECODE, as container images often set; this project's CI machine does): the suite
# starts about 90 Python processes, each of which would compile the package's 14,000 lines again (0.2 CPU-s), and
# each pytest worker would rewrite the test modules' assertions again.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# JAX's persistent compilation cache for the whole session, this process and every process a test starts
# (JAX reads these variables when it starts): the tests compile the same few steps of a tiny model over and
# over, as a user's runs do with trainer.compilation_cache_dir, and compile time is not what they test. One
# cache for every pytest-xdist worker: the controller makes it, the workers it starts inherit its environment
# (a cache per worker compiled most programs twice).
SESSION_CACHE_ENV = "ELASTIC_TRAINER_TESTS_JAX_CACHE"
IS_CONTROLLER = SESSION_CACHE_ENV not in os.environ
if IS_CONTROLLER:
    os.environ[SESSION_CACHE_ENV] = tempfile.mkdtemp(prefix="elastic_trainer_tests_jax_cache_")
COMPILATION_CACHE = os.environ[SESSION_CACHE_ENV]
# Runs that tests of both pytest-xdist workers compare with (tests/test_fault_matrix.py, reference_checkpoints) are
# made once, by whichever worker needs one first, in a directory of the session that both see.
SESSION_SHARED_ENV = "ELASTIC_TRAINER_TESTS_SHARED"
if IS_CONTROLLER:
    os.environ[SESSION_SHARED_ENV] = tempfile.mkdtemp(prefix="elastic_trainer_tests_shared_")
SESSION_SHARED = os.environ[SESSION_SHARED_ENV]
os.environ["JAX_COMPILATION_CACHE_DIR"] = COMPILATION_CACHE
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

# XLA:CPU generates the tests' code at LLVM's -O0, here and in every process a test starts: the tests check what
# the package does with the programs (same HLO, same meshes, same order of operations), not how fast XLA's code
# runs, and a process other than 0 of a multi-process job compiles every program anew each run (JAX writes the
# persistent cache from process 0 only, and on CPU its key holds each process's own topology fingerprint:
# jax/_src/cache_key.py, _hash_accelerator_config). Measured on 2 cores: the default suite took 762 user CPU-s and
# 7 min 39 s at XLA's default level, 671 CPU-s and 6 min 49 s at -O0. Where the installed XLA still has them, it
# also generates the code with XLA:CPU's element-wise emitters instead of its newer fusion emitters, which compile
# the tests' step in 0.20 s instead of 0.55 s and a model's eager initialisation in 0.5 s instead of 1.2 s: the
# suite went from 7 min 38 s and 835 CPU-s to 6 min 52 s and 731 CPU-s (2026-12-06, jax 0.10.2, 2 cores, back to
# back). The XLA of jax 0.12 has only the fusion emitters, and an XLA flag it does not know aborts the process, so
# a process with the flag starts JAX once first (the controller only: the workers and every process a test starts
# inherit its XLA_FLAGS). Benchmarks keep XLA's defaults.
O0 = "--xla_backend_optimization_level=0"
ELEMENTAL_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _xla_accepts(flags: str) -> bool:
    """Whether JAX's CPU backend starts with ``flags`` as XLA_FLAGS."""
    probe = [sys.executable, "-c", "import jax; jax.devices('cpu')"]
    return subprocess.run(probe, env={**os.environ, "XLA_FLAGS": flags}, capture_output=True).returncode == 0


if IS_CONTROLLER:
    flags = os.environ.get("XLA_FLAGS", "")
    if O0 not in flags:
        flags = f"{flags} {O0}".strip()
    if ELEMENTAL_EMITTERS not in flags and _xla_accepts(f"{flags} {ELEMENTAL_EMITTERS}"):
        flags = f"{flags} {ELEMENTAL_EMITTERS}"
    os.environ["XLA_FLAGS"] = flags

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

import elastic_trainer as et  # noqa: E402


class CountingData(et.AbstractDataset):
    """Samples whose tokens spell their own index: easy to check which were consumed."""

    def __init__(self, num_samples: int = 64, seq_len: int = 8):
        self.num_samples = num_samples
        self.seq_len = seq_len

    def get_batch(self, sample_ids: np.ndarray) -> np.ndarray:
        return ((sample_ids[:, None] + np.arange(self.seq_len + 1)) % 16).astype(np.int32)


@pytest.fixture
def tiny_trainer_kwargs():
    """Everything a Trainer needs for a model that trains in well under a second per step."""

    def make(**overrides):
        kwargs = dict(
            model=et.Transformer(vocab_size=16, seq_len=8, d_model=16, num_heads=2, num_layers=1, key=jax.random.key(0)),
            loss_fn=et.next_token_loss,
            optimizer=optax.adam(1e-2),
            data=CountingData(),
            steps=4,
            global_batch_size=16,
            cluster=et.SimulatedCluster(slices=4, devices_per_slice=2),
        )
        kwargs.update(overrides)
        return kwargs

    return make


def pytest_sessionfinish(session, exitstatus):
    """Remove the session's compilation cache and shared runs, once every worker is done with them."""
    if IS_CONTROLLER:
        shutil.rmtree(COMPILATION_CACHE, ignore_errors=True)
        shutil.rmtree(SESSION_SHARED, ignore_errors=True)


COSTLIEST_FIRST = (
    "test_multiprocess.py", "test_fault_matrix.py", "test_slow_peer.py", "test_diloco.py", "test_bad_input.py",
    "test_benchmark.py", "test_gcs.py", "test_pathways_simulator.py", "test_docs_site.py",
    "test_recovery.py", "test_crash_loop.py", "test_cli_errors.py", "test_preemption.py", "test_cli_recovery.py",
    "test_cli.py", "test_restarts.py", "test_properties.py", "test_soak.py", "test_plan.py", "test_training_mode.py",
    "test_step_cache.py", "test_checkpoint.py", "test_readme_command.py", "test_your_model.py", "test_hot_swap.py",
    "test_checkpoint_io.py", "test_config.py", "test_example_plugin.py", "test_checkpoint_checksums.py",
    "test_logger.py", "test_nnx.py", "test_checkpoint_failures.py", "test_elastic_retry.py", "test_trainer.py",
)
"""The test files that take longest, longest first (on 2 cores: from 100 s for the first two to 4 s for the
last), collected first, the others (about a second or less each) after them in their own order. pytest-xdist hands
whole files to its two workers in collection order (``--dist loadfile --no-loadscope-reorder``, ``pyproject.toml``),
so the long files start early and the short ones even out the workers' ends: in xdist's own order (most tests
first) one worker finished 9 to 22 s before the other, in this order within a second."""


def pytest_collection_modifyitems(config, items):
    """Collect :data:`COSTLIEST_FIRST` first, in that order (a stable sort: each file's tests keep theirs)."""
    rank = {name: position for position, name in enumerate(COSTLIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
