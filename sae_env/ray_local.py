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

The variables are set for the cluster's whole life (its processes inherit them when they start; the driver reads the
usage-stats switch later too) and restored, with ``HOME``, when it shuts down. ``HOME`` itself is restored as soon
as ``ray.init`` returns, and the private folder removed at shutdown.

With ``address`` (``--ray-address`` on the command line) the cluster is the user's: we connect to it, change no
environment and leave its network settings to whoever runs it. If Ray is already initialised in this process the
context manager uses that connection and leaves it open.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["LOCAL_ENV", "ray_cluster"]

# The environment a private local cluster starts with (see the module docstring).
LOCAL_ENV: dict[str, str] = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
}
_MAX_TEMP_DIR = 40  # characters: Ray appends ~60 (session_<date>_<pid>/sockets/plasma_store) to socket paths


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
    ``/tmp/rayXXXX``, removed afterwards; a given one must be short, see the module docstring);
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
        ray.init(address=address, **init_options)
        try:
            yield ray
        finally:
            ray.shutdown()
        return

    if temp_dir is not None and len(str(temp_dir)) > _MAX_TEMP_DIR:
        raise ValueError(f"ray temp_dir {temp_dir!r} is longer than {_MAX_TEMP_DIR} characters: Ray's socket paths "
                         "under it would pass the 107-byte limit; use a short path under /tmp")
    if num_cpus is not None and (isinstance(num_cpus, bool) or int(num_cpus) < 1):
        raise ValueError(f"num_cpus must be >= 1, got {num_cpus!r}")
    home = tempfile.mkdtemp(prefix="rayhome", dir="/tmp")
    own_temp = temp_dir is None
    session_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp") if own_temp else str(temp_dir)
    # An empty bootstrap config: its presence is what stops the head's cloud-metadata probe.
    open(os.path.join(home, "ray_bootstrap_config.yaml"), "w").close()
    old = _set_env({**LOCAL_ENV, "HOME": home})
    started = False
    patched = False
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
        started = True
        os.environ["HOME"] = old["HOME"] if old["HOME"] is not None else home  # the cluster has started
        yield ray
    finally:
        if started:
            ray.shutdown()
        if patched:
            ray_constants.ENABLE_RAY_CLUSTER = True
        _set_env(old)
        shutil.rmtree(home, ignore_errors=True)
        if own_temp:
            shutil.rmtree(session_dir, ignore_errors=True)
