"""JAX's coordination service apart from the training processes: the settings, the errors, the coordinator's CLI.

Losing process 0 itself is run for real in tests/test_fault_matrix.py (the multiprocess cells) and
tests/test_multiprocess.py (a simulated Slurm job with the coordinator as a task of its own).
"""

import pytest

import elastic_trainer as et
from elastic_trainer import coordinator
from elastic_trainer._failures import ConfigError
from elastic_trainer.clusters.multicontroller._coordinator import COORDINATOR_ENV, join_as_client
from elastic_trainer.launch._launcher import _say_who_ended


def test_any_slice_may_be_lost_with_a_separate_coordinator_but_not_process_0s_with_process0():
    separate = et.MultiprocessCluster(num_processes=3)
    assert separate.coordinator == "separate" and separate.protected_slices == ()
    separate._injection._check_index(0)  # allowed: the launcher hosts the service
    in_process_0 = et.MultiprocessCluster(num_processes=3, coordinator="process0")
    assert in_process_0.protected_slices == (0,)
    with pytest.raises(ConfigError, match="slice 0 holds process 0, which hosts JAX's coordination service"):
        in_process_0.fail_slice(0, down_for_s=1.0)


def test_a_training_process_with_no_coordinator_to_join_says_how_to_name_it(monkeypatch):
    for name in (COORDINATOR_ENV, "SLURM_JOB_ID", "JAX_COORDINATOR_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match=f"set {COORDINATOR_ENV} to where python -m elastic_trainer.coordinator"):
        join_as_client(num_processes=None, process_id=None, heartbeat_timeout_s=3, initialization_timeout_s=1)


@pytest.mark.parametrize("args", [["--num-processes", "0"], ["--num-processes", "2", "--port", "70000"], []])
def test_the_coordinator_refuses_bad_arguments_with_status_2(args, capsys):
    with pytest.raises(SystemExit) as exited:
        coordinator.main(args)
    assert exited.value.code == 2 and "error:" in capsys.readouterr().err


def test_the_launcher_says_which_process_ended_and_where_the_output_now_goes(tmp_path, capsys):
    seen = [None, None, None]
    _say_who_ended([None, None, None], seen, run_dir=tmp_path)
    _say_who_ended([-9, None, None], seen, run_dir=tmp_path)
    _say_who_ended([-9, 0, None], seen, run_dir=tmp_path)  # ended by itself: nothing to say
    _say_who_ended([-9, 0, None], seen, run_dir=tmp_path)  # said once
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"elastic_trainer: launcher: process 0 ended with status -9; processes [1, 2] go on "
                     f"(output: {tmp_path / 'process1' / 'stdout.log'})"]
