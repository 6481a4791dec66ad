"""A private local Ray cluster that sends nothing off the machine, or a cluster the user points us to.

Out of the box a local ``ray.init`` reaches off the machine even with the dashboard and usage stats off (cloud
metadata probes, a route lookup towards a public DNS address, a usage-stats POST; see the project's NOTES.md, measured
with ``strace -f -e trace=connect,sendto``). :func:`ray_cluster` starts one with every switch that stops it:

* ``RAY_USAGE_STATS_ENABLED=0`` (no usage report), ``RAY_AUTH_MODE=disabled``, ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``
  (binds every Ray process to 127.0.0.1, so node-IP discovery makes no route lookup);
* ``HOME`` pointing, while Ray starts, at a private folder that holds an EMPTY ``ray_bootstrap_config.yaml``: the
  head's cloud-provider probe runs only when that file is missing, and no setting turns it off;
* ``ray.init(address="local", include_dashboard=False, ...)``: ``"local"`` always starts a new cluster, whatever a
  stray ``RAY_ADDRESS`` says (an address with nothing behind it would hang for minutes);
* a short ``_temp_dir`` under /tmp (Ray's socket paths must stay under 107 bytes; pytest's ``tmp_path`` is too long).

Leftovers: the session folder and the private ``HOME`` (``/tmp/sae-ray-*``, ``/tmp/sae-rayhome-*``) are removed when
the cluster shuts down, also on SIGTERM (turned into SystemExit while the cluster is up, so that the clean-up runs;
taken back from the C handler that ``ray.init`` installs, which aborts the process when one of Ray's threads takes
the signal, see :func:`_take_back_sigterm`).
A SIGKILL leaves them behind; each holds an owner file (pid and start time of the process that made it), and the
next local cluster removes those whose owner is gone (its Ray processes share its fate and are gone too).

The variables are set for the cluster's whole life (its processes inherit them when they start; the driver reads the
usage-stats switch later too) and restored, with ``HOME``, when it shuts down. ``HOME`` itself is restored as soon
as ``ray.init`` returns, and the private folder removed at shutdown.

With ``address`` (``--ray-address`` on the command line) the cluster is the user's: we connect to it, change no
environment and leave its network settings to whoever runs it; SIGTERM is taken back as with a local cluster (a
driver's core worker installs the same C handler), so the connection is shut down. If Ray is already initialised in
this process the context manager uses that connection and leaves it open.

:func:`head_node` starts the same kind of private cluster as a separate head node (``ray start --head``, with the
same variables and ``HOME`` arrangement) that serves Ray Client on loopback: what a test of ``--ray-address
ray://127.0.0.1:PORT`` connects to, or a user trying Ray Client on one machine. It is stopped through its own process
group, never with ``ray stop`` (which stops every Ray cluster of the user on the machine).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["HEAD_ENV", "LOCAL_ENV", "clean_stale_folders", "head_node", "own_folder", "ray_cluster", "remove_folder"]

# The environment a private local cluster starts with (see the module docstring).
LOCAL_ENV: dict[str, str] = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
}
# A head started by `ray start` (head_node) needs two more than ray.init's cluster (both measured with strace here):
HEAD_ENV: dict[str, str] = {
    **LOCAL_ENV,
    # With usage stats off, the dashboard head of a `ray start` cluster (not of a ray.init one) still POSTs a "usage
    # disabled" report to Ray's server: send it to a closed loopback port instead.
    "RAY_USAGE_STATS_REPORT_URL": "http://127.0.0.1:9/",
    # gRPC's default epoll poller races with the fork by which the head's client proxy starts a server per client
    # (ray-project/ray#63202: that server dies; 3 of 11 first connections here); the plain poll poller does not
    # (0 of 9).
    "GRPC_POLL_STRATEGY": "poll",
}
_MAX_TEMP_DIR = 40  # characters: Ray appends ~60 (session_<date>_<pid>/sockets/plasma_store) to socket paths


def _private_home() -> str:
    """A fresh folder for ``HOME`` while Ray starts, holding the EMPTY bootstrap config that stops the head's
    cloud-provider probe (see the module docstring)."""
    home = own_folder(_HOME_PREFIX)
    open(os.path.join(home, "ray_bootstrap_config.yaml"), "w").close()
    return home


def _set_env(values: dict[str, str | None]) -> dict[str, str | None]:
    """Set (or, for None, unset) variables; return their previous values."""
    old = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    return old


@contextmanager
def ray_cluster(num_cpus: int | None = None, address: str | None = None, temp_dir: str | None = None,
                object_store_memory: int | None = None, **init_options: Any) -> Iterator[Any]:
    """Run the body with Ray initialised: a private local cluster (default) or the cluster at ``address``.

    ``num_cpus``: CPUs of the local cluster (default: all); ``temp_dir``: Ray's session folder (default: a fresh
    ``/tmp/sae-ray-XXXX``, removed afterwards; a given one must be short, see the module docstring);
    ``object_store_memory``: bytes (default: Ray's); other keyword arguments go to ``ray.init``. Yields the
    ``ray`` module.
    """
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():  # someone else's connection: use it
        yield sys.modules["ray"]
        return
    if address is not None:
        import ray

        if not isinstance(address, str) or not address:
            raise ValueError(f"ray address must be a non-empty string such as 'ray://host:10001', got {address!r}")
        term = _exit_on_sigterm()
        try:
            _connect(ray, address, init_options)
            _take_back_sigterm(term)
            yield ray
        finally:
            if ray.is_initialized():
                ray.shutdown()
            if term is not None:
                signal.signal(signal.SIGTERM, term[0])
        return

    if temp_dir is not None and len(str(temp_dir)) > _MAX_TEMP_DIR:
        raise ValueError(f"ray temp_dir {temp_dir!r} is longer than {_MAX_TEMP_DIR} characters: Ray's socket paths "
                         "under it would pass the 107-byte limit; use a short path under /tmp")
    if num_cpus is not None and (isinstance(num_cpus, bool) or int(num_cpus) < 1):
        raise ValueError(f"num_cpus must be >= 1, got {num_cpus!r}")
    clean_stale_folders()
    home = _private_home()
    own_temp = temp_dir is None
    session_dir = own_folder(_SESSION_PREFIX) if own_temp else str(temp_dir)
    old = _set_env({**LOCAL_ENV, "HOME": home})
    ray = None
    patched = False
    term = _exit_on_sigterm()
    try:
        import ray  # after the variables: ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, at its first import
        from ray._private import ray_constants

        if ray_constants.ENABLE_RAY_CLUSTER:
            # Ray was imported before with the switch on: node-IP discovery would make a route lookup.
            ray_constants.ENABLE_RAY_CLUSTER = False
            patched = True
        options = {"include_dashboard": False, "log_to_driver": False, **init_options}
        if object_store_memory is not None:
            options["object_store_memory"] = int(object_store_memory)
        ray.init(address="local", num_cpus=None if num_cpus is None else int(num_cpus), _temp_dir=session_dir,
                 **options)
        _take_back_sigterm(term)
        os.environ["HOME"] = old["HOME"] if old["HOME"] is not None else home  # the cluster has started
        yield ray
    finally:
        if ray is not None:  # also when ray.init stopped half-way (a SIGTERM in it): the processes it started go
            ray.shutdown()
        if patched:
            ray_constants.ENABLE_RAY_CLUSTER = True
        _set_env(old)
        remove_folder(home)
        if own_temp:
            remove_folder(session_dir)
        if term is not None:
            signal.signal(signal.SIGTERM, term[0])


_CLIENT_ATTEMPTS = 3


def _connect(ray: Any, address: str, init_options: dict[str, Any]) -> None:
    """``ray.init(address)``; through Ray Client (``ray://``) retried: the head's client proxy starts a server
    process per client, which now and then dies while it forks (a race in gRPC, ray-project/ray#63202: the client
    sees ConnectionAbortedError). Measured here: 3 of 6 first connections to a fresh ``ray start --head``."""
    for attempt in range(1, _CLIENT_ATTEMPTS + 1):
        try:
            ray.init(address=address, **init_options)
            return
        except ConnectionAbortedError as e:
            ray.shutdown()
            if not address.startswith("ray://") or attempt == _CLIENT_ATTEMPTS:
                raise
            print(f"warning: Ray Client at {address}: the server's session for this client failed to start "
                  f"({str(e).strip().splitlines()[-1][:200]}); retrying ({attempt}/{_CLIENT_ATTEMPTS - 1})",
                  file=sys.stderr)
            time.sleep(1.0)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@contextmanager
def head_node(num_cpus: int | None = None, client_port: int | None = None, num_gpus: int | None = None,
              start_timeout_s: float = 120.0) -> Iterator[str]:
    """A private Ray head node (``ray start --head --block``) bound to loopback, serving Ray Client; yields its
    address ``ray://127.0.0.1:PORT``.

    Started with :data:`HEAD_ENV` and a private ``HOME`` (nothing leaves the machine, as :func:`ray_cluster`), in a
    process group of its own with a fresh session folder under /tmp; at exit the group gets SIGTERM, then SIGKILL
    (:func:`_stop_group`), and the folders are removed. RuntimeError, with the end of Ray's output, when the head
    does not serve Ray Client within ``start_timeout_s``.
    """
    if num_cpus is not None and (isinstance(num_cpus, bool) or int(num_cpus) < 1):
        raise ValueError(f"num_cpus must be >= 1, got {num_cpus!r}")
    clean_stale_folders()
    home = _private_home()
    session_dir = own_folder(_SESSION_PREFIX)
    client_port = int(client_port) if client_port is not None else _free_port()
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--node-ip-address=127.0.0.1",
           f"--port={_free_port()}", f"--ray-client-server-port={client_port}", "--include-dashboard=false",
           "--disable-usage-stats", f"--temp-dir={session_dir}"]
    if num_cpus is not None:
        cmd.append(f"--num-cpus={int(num_cpus)}")
    if num_gpus is not None:
        cmd.append(f"--num-gpus={int(num_gpus)}")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(HEAD_ENV, HOME=home)
    log_path = os.path.join(session_dir, "ray-start.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + start_timeout_s
        while not _listening(client_port):
            if proc.poll() is not None or time.monotonic() > deadline:
                with open(log_path) as f:
                    tail = f.read()[-2000:]
                raise RuntimeError(f"ray start --head did not serve Ray Client on 127.0.0.1:{client_port} "
                                   f"(exit status {proc.poll()}):\n{tail}")
            time.sleep(0.5)
        yield f"ray://127.0.0.1:{client_port}"
    finally:
        _stop_group(proc)
        remove_folder(home)
        remove_folder(session_dir)


def _stop_group(proc: subprocess.Popen, grace_s: float = 3.0) -> None:
    """SIGTERM to the head's process group (every Ray process it started), then SIGKILL to whatever is left: the
    head itself drains for up to 30 s after a SIGTERM, and nothing of a private head needs saving."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the whole group is gone
        pass
    proc.wait()


_TMP = "/tmp"
_SESSION_PREFIX = "sae-ray-"
_HOME_PREFIX = "sae-rayhome-"
_OWNER = ".sae-owner"  # "<pid> <start time>" of the process that made the folder


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks after boot, from /proc), or None when it does not exist. With
    the pid it names a process for good: a pid can be reused, a (pid, start time) pair cannot. Without /proc, "?"
    for a live pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        if Path("/proc/self/stat").exists():
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "?"
    return stat.rsplit(")", 1)[1].split()[19]  # field 22 (starttime); the name in (...) may hold spaces


def own_folder(prefix: str) -> str:
    """A fresh folder under /tmp marked with this process as its owner."""
    folder = tempfile.mkdtemp(prefix=prefix, dir=_TMP)
    Path(folder, _OWNER).write_text(f"{os.getpid()} {_process_start(os.getpid())}\n")
    return folder


def clean_stale_folders(tmp: str = _TMP) -> list[str]:
    """Remove the session and HOME folders of local clusters whose owner process is gone (killed before it could
    clean up); folders of live processes, and folders not made here, are left alone. Returns the removed paths."""
    removed = []
    for folder in Path(tmp).glob(f"{_SESSION_PREFIX[:-1]}*"):
        if not folder.name.startswith((_SESSION_PREFIX, _HOME_PREFIX)) or not folder.is_dir():
            continue
        try:
            pid, start = Path(folder, _OWNER).read_text().split()
            alive = _process_start(int(pid))
        except (OSError, ValueError):
            continue  # no owner file (not ours, or being made this instant): leave it
        # one pass: its owner is gone, and its Ray processes with it, so nothing writes there any more
        if (alive is None or (alive != start and "?" not in (alive, start))) and remove_folder(str(folder), tries=1):
            removed.append(str(folder))
    return removed


def remove_folder(folder: str, tries: int = 20, pause_s: float = 0.05) -> bool:
    """Remove a folder that :func:`own_folder` made, its owner file last; returns whether it is gone.

    Ray's processes that are still ending (a worker whose raylet has just gone) may write into it meanwhile, so a
    pass that leaves something is tried again, ``tries`` times ``pause_s`` apart; a folder still there keeps its
    owner file, with which the next local cluster removes it once this process is gone (without it, it would stay
    for good)."""
    path = Path(folder)
    owner = path / _OWNER
    try:
        mark = owner.read_text()
    except OSError:
        mark = None
    for attempt in range(tries):
        if attempt:
            time.sleep(pause_s)
        try:
            entries = [e for e in path.iterdir() if e.name != _OWNER]
        except FileNotFoundError:
            return True
        except OSError:
            continue
        for entry in entries:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                try:
                    entry.unlink(missing_ok=True)
                except OSError:
                    pass
        try:
            owner.unlink(missing_ok=True)
            path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:  # something new in it: mark it again and go on
            if mark is not None:
                try:
                    owner.write_text(mark)
                except OSError:
                    pass
    return False


def _exit_on_sigterm() -> tuple[Any, Any] | None:
    """While the cluster is up, SIGTERM raises SystemExit (so that the clean-up runs) instead of ending the process
    on the spot; a handler the user set (or SIG_IGN) stays. Returns (the handler before, the one kept while the
    cluster is up), or None off the main thread (handlers are the main thread's) or when the handler before was set
    outside Python (nothing to put back)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGTERM)
    if previous is None:
        return None

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    keep = handler if previous is signal.SIG_DFL else previous
    signal.signal(signal.SIGTERM, keep)
    return previous, keep


def _take_back_sigterm(term: tuple[Any, Any] | None) -> None:
    """Set SIGTERM's handler again after ``ray.init``, which replaced it twice: in Python (``sys.exit``, whatever
    the user had) and in C, where the driver's core worker installs abseil's failure handler. That one prints a stack
    and, when the signal lands on one of Ray's threads instead of the main thread, aborts the process (SIGABRT) about
    a second later unless the main thread has exited by then: no clean-up (ray 2.60, with ``signal.pthread_kill`` to
    its ``ray_listen_error_messages`` thread; a plain ``kill`` lands there now and then under load). Setting it again
    puts Python's C handler back: any thread may take the signal, and the main thread runs the Python handler when
    it next runs Python (a blocking call it is in, such as a long ``time.sleep``, finishes first)."""
    if term is not None:
        signal.signal(signal.SIGTERM, term[1])
