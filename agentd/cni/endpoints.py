"""Local endpoint files: how agentd-cni tells the agent of its node which pod it attached.

After its delegate's ADD succeeds, ``agentd-cni`` writes ``<dataDir>/endpoints/<CNI_CONTAINERID>.json``
(atomically: temp file and rename) with the pod's identity, labels, named ports, addresses
and where it is attached; DEL removes the file.  The agent watches the directory (inotify)
and keeps, from these files, the pod's record in etcd (``<prefix>/resources/pods/<ns>/<name>``,
under its node lease) and the pod's place in the node's nftables.

ADD then waits (``policyTimeout`` seconds of the plugin config, default 2) until the agent
has programmed the pod into the node's tables - it says so by creating
``<dataDir>/endpoints/.programmed/<CNI_CONTAINERID>`` - so a pod that policy isolates is not
open while its containers start.  If the agent does not answer in time (it is not running),
ADD succeeds anyway, with a warning on stderr: pods must start without the agent too.

Files keep working when the agent is down (it reads them all when it starts) and need no
etcd credentials in the plugin.  A container without Kubernetes identity (not both
``K8S_POD_NAMESPACE`` and ``K8S_POD_NAME`` in CNI_ARGS, valid names: podman sends only the
container name) gets no file: it is neither selectable nor isolated.

Identity and labels, as a container runtime passes them:

* ``CNI_ARGS``: ``K8S_POD_NAMESPACE=<ns>;K8S_POD_NAME=<name>`` (what kubelet's CRI runtimes set);
* labels: ``args.cni.labels`` (CNI conventions: a list of ``{"key", "value"}``) and
  ``runtimeConfig.labels`` (an object), :data:`LABELS_MAX` bytes in all; later
  ``agentd label pod NS/NAME k=v``;
* named container ports: ``runtimeConfig.containerPorts`` or ``args.cni.containerPorts``, a
  list of ``{"name", "containerPort", "protocol"}`` as in a Kubernetes pod spec (its
  ``hostPort`` and ``hostIP`` are accepted and dropped).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import ipaddress
import json
import logging
import os
import secrets
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from agentd.resources import pod as podres
from agentd.resources.validation import Invalid, dns1123_label, dns1123_subdomain, labels as check_labels

log = logging.getLogger("agentd.cni")

SUBDIR = "endpoints"
SUFFIX = ".json"
PROGRAMMED = ".programmed"
DEFAULT_WAIT = 2.0
HOST_PORT_FIELDS = ("hostPort", "hostIP")  # of a Kubernetes ContainerPort: accepted, not kept
#: Bytes of a pod's labels ADD takes, counted as flow records count them (key + value + 8 each,
#: agentd/flows/model.py LABELS_MAX): a runtime passing more gets ADD refused, not the labels
#: cut, since labels select the pod for network policy and a pod short of some would be
#: selected (isolated, allowed) as another pod is.  Kubernetes caps no pod's labels in all.
#: Not CHECK (a pod an older agentd-cni added with more must pass it); ``agentd label pod``
#: has the same cap (agentd/resources/store.py).
LABELS_MAX = 16 << 10


class EndpointError(ValueError):
    """Bad identity, labels or ports from the runtime; the message is one line."""


@dataclass(frozen=True)
class Endpoint:
    container_id: str
    namespace: str
    name: str
    labels: dict[str, str]
    ports: list[dict[str, Any]]
    ips: list[str]
    interface: str  # host side of the pod's veth
    mac: str  # its MAC
    bridge: str
    # The MAC of the pod's own interface (the veth's other end, in the sandbox), as the
    # delegate's result names it: the only source MAC the bridge takes from the pod's port.
    # "" where the delegate named none (or a file of an older plugin): that port's source
    # MAC is not checked.
    pod_mac: str = ""
    ifname: str = "eth0"
    netns: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    # The file's mtime (ns), as read_all found it; not in the file, not compared.  ADD writes
    # the file, so of two files with one address the newer is the pod host-local gave it to last.
    written: int = field(default=0, compare=False)
    # A token ADD (write()) makes new for each file it writes; relabelling keeps it.  In the
    # file, not compared (a re-ADD's file with the same content is the same pod).
    generation: str = field(default="", compare=False)
    # Which write of the file this is (see file_ident()), as read_all found it; not in the file,
    # not compared.  A DEL and ADD of one container ID within one mtime tick leave a file
    # with the same mtime (and maybe the same content): this still tells them apart.
    ident: str = field(default="", compare=False)

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    def to_json(self) -> str:
        out = asdict(self)
        del out["written"], out["ident"]
        if not out["generation"]:
            del out["generation"]
        return json.dumps(out, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Endpoint:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("not an object")
        known = {f: raw[f] for f in cls.__dataclass_fields__ if f in raw and f not in ("written", "ident")}
        ep = cls(**known)
        if not isinstance(ep.generation, str):
            raise TypeError("field 'generation' is not a string")
        for f in ("container_id", "namespace", "name", "interface", "mac", "bridge"):
            if not isinstance(getattr(ep, f), str) or not getattr(ep, f):
                raise ValueError(f"field {f!r} missing or not a string")
        if not isinstance(ep.pod_mac, str):
            raise ValueError("field 'pod_mac' is not a string")
        if not isinstance(ep.labels, dict) or not isinstance(ep.ips, list) or not isinstance(ep.ports, list):
            raise ValueError("labels, ips or ports have the wrong type")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in ep.labels.items()):
            raise ValueError("labels must map strings to strings")
        for ip in ep.ips:
            if not isinstance(ip, str) or "%" in ip:
                raise ValueError(f"ips: {ip!r} is not an address")
            ipaddress.ip_address(ip)  # ValueError, naming it, if it is none
        for port in ep.ports:
            if not (isinstance(port, dict) and type(port.get("containerPort")) is int
                    and 1 <= port["containerPort"] <= 65535
                    and isinstance(port.get("name", ""), str) and isinstance(port.get("protocol", "TCP"), str)):
                raise ValueError(f"ports: {port!r} is not a named container port")
        return ep


def endpoints_dir(data_dir: str | os.PathLike[str]) -> str:
    return os.path.join(os.fspath(data_dir), SUBDIR)


# ------------------------------------------------------------------ the plugin's side


def parse_cni_args(text: str) -> dict[str, str]:
    """``K1=V1;K2=V2`` (CNI spec: CNI_ARGS) as a dict; pairs without '=' are ignored."""
    out = {}
    for part in text.split(";"):
        key, eq, value = part.partition("=")
        if eq and key.strip():
            out[key.strip()] = value.strip()
    return out


def labels_size(labels: Mapping[str, str]) -> int:
    """The bytes of ``labels`` as :data:`LABELS_MAX` counts them (key + value + 8 each)."""
    return sum(len(key) + len(value) + 8 for key, value in labels.items())


def labels_too_long(labels: Mapping[str, str]) -> str | None:
    """Why ``labels`` are more than a pod may have here (:data:`LABELS_MAX` bytes, key + value
    + 8 each), or None.  ADD and ``agentd label pod`` refuse such labels."""
    size = labels_size(labels)
    if size <= LABELS_MAX:
        return None
    return (f"{len(labels)} labels of {size} bytes (key + value + 8 each), more than the {LABELS_MAX} "
            "a pod may have here")  # fmt: skip


def identity(env: Mapping[str, str], netconf: Mapping[str, Any], warn: Callable[[str], None] | None = None, *,
             adding: bool = False) -> tuple[str, str, dict[str, str], list[dict[str, Any]]] | None:  # fmt: skip
    """(namespace, name, labels, named ports) of the pod being added, or None without identity.

    A container is a pod only with both ``K8S_POD_NAMESPACE`` and ``K8S_POD_NAME``, each a
    valid Kubernetes name.  Runtimes other than kubelet's send names that are no pod's:
    podman with its CNI backend sends the container name as ``K8S_POD_NAME`` alone
    (containers/common libnetwork/cni/run.go, podman#12083), podman 3 (ocicni) sends it as
    both, and its default names (``objective_tesla``) hold ``_``.  Such a container is
    attached without identity, as one without these keys is, and ``warn`` is told why (one
    line).  (A podman 3 container named with a valid name, ``web``, cannot be told from a pod:
    it is pod ``web/web``; docs/policy.md says so.)

    Raises EndpointError (one line, naming the field) for a pod's bad labels or ports: they
    are checked before anything is set up.  Labels over :data:`LABELS_MAX` bytes only when
    ``adding`` (ADD): CHECK of a pod an older agentd-cni added with more must not fail."""
    args = parse_cni_args(env.get("CNI_ARGS", ""))
    ns, name = args.get("K8S_POD_NAMESPACE", ""), args.get("K8S_POD_NAME", "")
    if not ns and not name:
        return None
    problem = _pod_name_problem(ns, name)
    if problem:
        if warn is not None:
            warn(problem)
        return None
    cni_args = ((netconf.get("args") or {}).get("cni") or {}) if isinstance(netconf.get("args"), dict) else {}
    runtime = netconf.get("runtimeConfig") if isinstance(netconf.get("runtimeConfig"), dict) else {}
    labels: dict[str, Any] = {}
    listed = cni_args.get("labels") if isinstance(cni_args, dict) else None
    if listed is not None:
        if not isinstance(listed, list) or not all(isinstance(x, dict) and isinstance(x.get("key"), str)
                                                   and isinstance(x.get("value", ""), str) for x in listed):
            raise EndpointError("args.cni.labels must be a list of {\"key\": ..., \"value\": ...}")
        labels.update({x["key"]: x.get("value", "") for x in listed})
    if runtime.get("labels") is not None:
        if not isinstance(runtime["labels"], dict):
            raise EndpointError("runtimeConfig.labels must be an object")
        labels.update(runtime["labels"])
    try:
        labels = check_labels(labels, "labels")
    except Invalid as err:
        raise EndpointError(str(err)) from None
    too_long = labels_too_long(labels) if adding else None
    if too_long:
        raise EndpointError(f"labels: Too long: {too_long}")
    ports_raw = runtime.get("containerPorts")
    if ports_raw is None and isinstance(cni_args, dict):
        ports_raw = cni_args.get("containerPorts")
    seen: set[str] = set()
    try:
        if ports_raw is not None and not isinstance(ports_raw, list):
            raise Invalid("containerPorts", "must be a list")
        # A pod spec's ContainerPort may also say hostPort and hostIP: the runtime passes those to
        # portmap (runtimeConfig.portMappings); the pod's record keeps only the named port.
        ports = [podres.container_port(p, f"containerPorts[{i}]", seen, ignored=HOST_PORT_FIELDS)
                 for i, p in enumerate(ports_raw or [])]
    except Invalid as err:
        raise EndpointError(str(err)) from None
    return ns, name, labels, ports


def _pod_name_problem(ns: str, name: str) -> str:
    """Why CNI_ARGS name no pod ("" if they name one)."""
    if not ns:
        return "CNI_ARGS has K8S_POD_NAME but no K8S_POD_NAMESPACE"
    if not name:
        return "CNI_ARGS has K8S_POD_NAMESPACE but no K8S_POD_NAME"
    try:
        dns1123_label(ns, "CNI_ARGS K8S_POD_NAMESPACE")
        dns1123_subdomain(name, "CNI_ARGS K8S_POD_NAME")
    except Invalid as err:
        return str(err)
    return ""


def attachment(result: Mapping[str, Any], bridge: str) -> tuple[list[str], str, str]:
    """(pod addresses, host-side veth, its MAC) from the bridge plugin's ADD result."""
    ips = []
    for entry in result.get("ips") or []:
        addr = str(entry.get("address", "")).split("/")[0]
        if addr:
            ips.append(addr)
    host = [
        i for i in result.get("interfaces") or []
        if isinstance(i, dict) and not i.get("sandbox") and i.get("name") != bridge
    ]  # fmt: skip
    if not ips or not host:
        raise EndpointError("the delegate's result names no address or no host-side interface")
    return ips, str(host[0]["name"]), str(host[0].get("mac", ""))


def _mac(text: Any) -> str:
    """``text`` as a MAC normalised (lower case), or "" if it is none."""
    mac = str(text or "").strip().lower()
    parts = mac.split(":")
    if len(parts) == 6 and all(len(p) == 2 and all(c in "0123456789abcdef" for c in p) for p in parts):
        return mac
    return ""


def pod_mac(result: Mapping[str, Any], ifname: str, env: Mapping[str, str] | None = None,
            netconf: Mapping[str, Any] | None = None) -> str:
    """The MAC the pod's interface ``ifname`` will have: the one the ADD asks for (CNI_ARGS
    ``MAC=``, ``runtimeConfig.mac``: a plugin chained after agentd-cni, such as ``tuning``,
    sets it after the delegate has run), else the delegate's ADD result's (in its sandbox);
    normalised (lower case); "" if neither names one."""
    asked = _mac(parse_cni_args((env or {}).get("CNI_ARGS", "")).get("MAC"))
    runtime = (netconf or {}).get("runtimeConfig")
    if not asked and isinstance(runtime, dict):
        asked = _mac(runtime.get("mac"))
    if asked:
        return asked
    for i in result.get("interfaces") or []:
        if isinstance(i, dict) and i.get("sandbox") and i.get("name") == ifname:
            mac = _mac(i.get("mac"))
            if mac:
                return mac
    return ""


LOCK = ".lock"  # flock(2)ed: the plugin's changes (shared) against the agent's checks (exclusive)
LOCK_MODE = 0o600  # only its owner (the agent's user) and root open it: no one else can hold it
PLUGIN_LOCK_WAIT = 1.0  # the plugin waits this long for the lock, then goes on without it
AGENT_LOCK_TRIES = 5  # the agent tries this often, AGENT_LOCK_PAUSE apart, then skips the round
AGENT_LOCK_PAUSE = 0.01


class Busy(Exception):
    """``endpoints/.lock`` is held by someone else: the agent does not wait for it (it runs
    again at the next round)."""


_reported: set[str] = set()  # lock files this process could not open, logged once

# Opening a directory the agent's user may own (endpoints/ and what is in it) never goes
# through a symlink in its place: root's plugin would write, lock and unlink in whatever
# directory the symlink names (/etc/cni/net.d, its own state directory).  Each is opened once,
# and what is done in it is done relative to that descriptor.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Files there: never through a symlink, and never waiting on a FIFO put in a file's place.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def open_directory(name: str | os.PathLike[str], dir_fd: int | None = None, *, shown: str | None = None) -> int:
    """A descriptor of the directory ``name`` (relative to ``dir_fd``), never of what a symlink
    in its place names.  NotADirectoryError (its ``filename`` ``shown``, else ``name``) for a
    symlink or anything else that is no directory; FileNotFoundError without one."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as err:
        if err.errno in (errno.ENOTDIR, errno.ELOOP):
            raise NotADirectoryError(errno.ENOTDIR, "a symlink or no directory: refused", shown or os.fspath(name)) from None
        raise


@contextlib.contextmanager
def _endpoints(data_dir: str | os.PathLike[str], missing_ok: bool = False) -> Iterator[int | None]:
    """endpoints/ of ``data_dir``, open (:func:`open_directory`: a symlink is refused); None
    if it is not there and ``missing_ok``."""
    try:
        fd = open_directory(endpoints_dir(data_dir))
    except FileNotFoundError:
        if not missing_ok:
            raise
        yield None
        return
    try:
        yield fd
    finally:
        os.close(fd)


def _open_lock(dir_fd: int, directory: str) -> int | None:
    """A read-only fd of ``.lock`` in the directory ``dir_fd`` (``directory``, for messages),
    created (LOCK_MODE) if missing; None without it.

    Read-only: closing a file opened for writing would wake the agent's inotify watch.  The
    file is LOCK_MODE and, when root makes or finds it (the plugin under the runtime), owned by
    the directory's owner -- the agent's user when the agent runs as one of its own -- so that
    whichever of the two makes it first, both can open it and no one else can (flock needs
    only a read-only fd: a file others can read is one they can hold).  Only an empty regular
    file of one link is given away or made LOCK_MODE: the directory's owner could have put
    another file of root's there (a hard link, one it moved in), and root must not hand it
    over; one that is no regular file is not used (a FIFO: never waited on)."""
    path = os.path.join(directory, LOCK)
    try:
        try:
            fd = os.open(LOCK, _FILE_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            fd = os.open(LOCK, _FILE_FLAGS | os.O_CREAT, LOCK_MODE, dir_fd=dir_fd)
    except FileNotFoundError:
        return None  # the directory went: nothing to guard
    except OSError as err:
        if path not in _reported:
            _reported.add(path)
            log.warning("cannot open %s (%s): going on without it", path, err.strerror or err)
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        st = None
    if st is None or not stat.S_ISREG(st.st_mode):
        os.close(fd)
        if path not in _reported:
            _reported.add(path)
            log.warning("%s is no regular file: going on without it", path)
        return None
    if st.st_nlink != 1 or st.st_size != 0:
        return fd  # a lock to hold, not a file of root's to give away
    with contextlib.suppress(OSError):  # (without CAP_CHOWN: it stays whose it is)
        owner = os.fstat(dir_fd)
        if os.geteuid() == 0 and (st.st_uid, st.st_gid) != (owner.st_uid, owner.st_gid):
            os.fchown(fd, owner.st_uid, owner.st_gid)
    with contextlib.suppress(OSError):  # (not its owner: it stays as it is)
        if stat.S_IMODE(st.st_mode) != LOCK_MODE:  # one an earlier version made 0644
            os.fchmod(fd, LOCK_MODE)
    return fd


@contextlib.contextmanager
def _locked(data_dir: str | os.PathLike[str], exclusive: bool, dir_fd: int | None = None) -> Iterator[None]:
    """Hold ``endpoints/.lock``: agentd-cni shared while it writes or removes a container's files
    (plugins for different containers do not wait for each other), the agent exclusive while
    it checks that a file is still the one it read and acts on it (relabel, acknowledge).
    ``dir_fd``: endpoints/ as the caller opened it (else it is opened here).

    Neither waits for long: the agent tries AGENT_LOCK_TRIES times and raises Busy (the caller
    skips this round); the plugin waits up to PLUGIN_LOCK_WAIT, then goes on without it,
    logged.  Without the directory there is nothing to guard; a lock file that cannot be opened
    is gone without (logged once)."""
    own = None
    if dir_fd is None:
        with contextlib.suppress(FileNotFoundError):
            own = dir_fd = open_directory(endpoints_dir(data_dir))
    fd = _open_lock(dir_fd, endpoints_dir(data_dir)) if dir_fd is not None else None
    try:
        if fd is not None:
            if exclusive:
                for attempt in range(AGENT_LOCK_TRIES):
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if attempt + 1 == AGENT_LOCK_TRIES:
                            raise Busy(f"{os.path.join(endpoints_dir(data_dir), LOCK)} is held by another process") from None
                        time.sleep(AGENT_LOCK_PAUSE)
            else:
                deadline = time.monotonic() + PLUGIN_LOCK_WAIT
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() >= deadline:
                            log.warning("%s is held by another process for more than %.1f s: going on without it",
                                        os.path.join(endpoints_dir(data_dir), LOCK), PLUGIN_LOCK_WAIT)
                            break
                        time.sleep(0.005)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock
        if own is not None:
            os.close(own)


DIR_MODE = 0o755  # dataDir, endpoints/ and endpoints/.programmed: see _make_dir


def _make_dir(directory: str | os.PathLike[str], *, parents_owner: bool = True) -> None:
    """``directory`` (and its parents) if it is not there, DIR_MODE whatever the umask: the
    agent may run as a user of its own (docs/operations.md), the plugin as root under the
    runtime, and whichever makes a directory first, both must be able to use it.  So when
    root makes it (the plugin) and ``parents_owner``, it is given its parent's owner, as the
    lock is (_open_lock): endpoints/ dataDir's, the agent's user's when the agent made
    dataDir.  An existing directory is left as it is -- but with ``parents_owner`` (endpoints/,
    endpoints/.programmed: names in a directory the agent's user may own) it must be one, not a
    symlink to one (NotADirectoryError); dataDir and its parents are the operator's paths.

    The mode and owner are set through a descriptor opened with O_NOFOLLOW: a user owning
    the parent could put a symlink in the new directory's place, and root must not chmod or
    chown what it points at."""
    directory = os.path.normpath(os.fspath(directory))
    try:
        os.mkdir(directory, DIR_MODE)
    except FileExistsError:
        if parents_owner:
            os.close(open_directory(directory))
        return
    except FileNotFoundError:
        _make_dir(os.path.dirname(directory), parents_owner=False)
        try:
            os.mkdir(directory, DIR_MODE)
        except FileExistsError:
            if parents_owner:
                os.close(open_directory(directory))
            return
    fd = open_directory(directory)
    try:
        if parents_owner and os.geteuid() == 0:
            with contextlib.suppress(OSError):  # (without CAP_CHOWN: it stays root's)
                st, parent = os.fstat(fd), os.stat(os.path.dirname(directory))
                if (st.st_uid, st.st_gid) != (parent.st_uid, parent.st_gid):
                    os.fchown(fd, parent.st_uid, parent.st_gid)
        os.fchmod(fd, DIR_MODE)  # mkdir's mode is masked by the umask
    finally:
        os.close(fd)


def make_data_dir(data_dir: str | os.PathLike[str]) -> None:
    """The plugin's dataDir, DIR_MODE (not only root's: the agent reads endpoints/ in it), if
    it is not there; its owner is whoever makes it.  The plugin keeps its state files in a
    directory of its own in it (agentd.cni.plugin.STATE_SUBDIR: root's, 0700)."""
    _make_dir(data_dir, parents_owner=False)


def make_dirs(data_dir: str | os.PathLike[str]) -> None:
    """The agent's side, before it writes the subnet file (no ADD gets past it without one):
    dataDir, endpoints/ and endpoints/.programmed, DIR_MODE and the agent's own (its user's,
    when it runs as one), so that the plugin finds them and does not make them root's.  The
    ones there already are left as they are.  OSError (its ``filename`` the directory) if one
    cannot be made, or endpoints/ or .programmed is there but no directory (a symlink)."""
    make_data_dir(data_dir)
    _make_dir(endpoints_dir(data_dir))
    _make_dir(os.path.join(endpoints_dir(data_dir), PROGRAMMED))


_TEMP_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789_"  # tempfile's, which sweep_temp_files knows


def replace_at(dir_fd: int, name: str, data: bytes, mode: int, prefix: str) -> None:
    """Write ``name`` in the directory ``dir_fd`` whole: a new temporary file (``prefix`` and 8
    characters, as mkstemp names them), ``mode`` whatever the umask, fsynced before it takes the
    name (else a crash can leave the name with no content), then the directory fsynced (the
    rename itself).  Never through a symlink: the temporary file is made O_EXCL, the rename is
    of names in ``dir_fd``."""
    for _ in range(100):
        tmp = prefix + "".join(secrets.choice(_TEMP_CHARS) for _ in range(8))
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=dir_fd)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(errno.EEXIST, "no free temporary file name", prefix)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    with contextlib.suppress(OSError):
        os.fsync(dir_fd)  # some file systems cannot sync a directory; the file itself is on disk


def _replace(dir_fd: int, ep: Endpoint) -> None:
    # Readable by the agent when it runs as a user of its own (docs/operations.md): the plugin
    # runs as root under the container runtime.  Nothing secret in it.
    replace_at(dir_fd, ep.container_id + SUFFIX, ep.to_json().encode(), 0o644, f".{ep.container_id}.")


def _unmark(dir_fd: int, container_id: str, directory: str) -> None:
    """Remove the container's acknowledgement from endpoints/.programmed (``dir_fd`` endpoints/;
    ``directory`` it, for messages); none (or no .programmed) is nothing to do, a .programmed
    that is no directory (a symlink) is refused."""
    try:
        fd = open_directory(PROGRAMMED, dir_fd, shown=os.path.join(directory, PROGRAMMED))
    except FileNotFoundError:
        return
    try:
        os.unlink(container_id, dir_fd=fd)
    except FileNotFoundError:
        pass
    except OSError as err:
        if err.errno != errno.ENAMETOOLONG:  # no such file can exist
            raise
    finally:
        os.close(fd)


def write(data_dir: str | os.PathLike[str], ep: Endpoint) -> None:
    """ADD's side: the container's endpoint file, new (with a generation of its own: see
    file_ident()).  An acknowledgement left for the same container ID (a DEL that never came, or
    one that came and an agent acknowledged the old file since) goes first: ADD waits for the
    agent to acknowledge this file.  endpoints/ (and .programmed) must be directories, not
    symlinks: NotADirectoryError."""
    directory = endpoints_dir(data_dir)
    _make_dir(directory)
    ep = replace(ep, generation=secrets.token_hex(8))
    with _endpoints(data_dir) as fd, _locked(data_dir, exclusive=False, dir_fd=fd):
        _unmark(fd, ep.container_id, directory)
        _replace(fd, ep)


def file_ident(generation: str, st: os.stat_result) -> str:
    """Which write of an endpoint file this is: its generation (new at every ADD), or for a
    file an older agentd-cni wrote without one, inode number, mtime (ns) and size -- never the
    mtime alone, which a DEL and ADD within one clock tick (the file system's timestamps are
    coarse) leave the same."""
    return f"g:{generation}" if generation else f"s:{st.st_ino}:{st.st_mtime_ns}:{st.st_size}"


def read(data_dir: str | os.PathLike[str], container_id: str) -> Endpoint | None:
    """The container's endpoint file; None if it is not there or not readable as one."""
    try:
        with _endpoints(data_dir) as dir_fd:
            fd = os.open(container_id + SUFFIX, _FILE_FLAGS, dir_fd=dir_fd)
        with os.fdopen(fd, encoding="utf-8") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            return Endpoint.from_json(f.read())
    except (OSError, ValueError, TypeError):
        return None


def remove(data_dir: str | os.PathLike[str], container_id: str) -> None:
    """DEL's side: the container's endpoint file and its acknowledgement go (none: nothing to do).
    endpoints/ (and .programmed) must be directories, not symlinks: NotADirectoryError."""
    with _endpoints(data_dir, missing_ok=True) as fd:
        if fd is None:
            return
        with _locked(data_dir, exclusive=False, dir_fd=fd):
            try:
                os.unlink(container_id + SUFFIX, dir_fd=fd)
            except FileNotFoundError:
                pass
            except OSError as err:
                if err.errno != errno.ENAMETOOLONG:  # no such file can exist
                    raise
            _unmark(fd, container_id, endpoints_dir(data_dir))


def _programmed(data_dir: str | os.PathLike[str], container_id: str) -> str:
    return os.path.join(endpoints_dir(data_dir), PROGRAMMED, container_id)


def wait_programmed(data_dir: str | os.PathLike[str], container_id: str, timeout: float) -> bool:
    """Wait until the agent says the pod is in the node's tables; False after ``timeout``."""
    path = _programmed(data_dir, container_id)
    deadline = time.monotonic() + timeout
    while True:
        if os.path.exists(path):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)


def acknowledge(
    data_dir: str | os.PathLike[str], programmed: set[tuple[str, str]], before: set[tuple[str, str]]
) -> set[tuple[str, str]]:
    """The agent's side: mark the ``programmed`` attachments -- (container ID, the file's
    ``ident``) -- and unmark the containers of ``before`` that are not among them.  An
    attachment is marked only while its file is still the one the agent programmed: a DEL and
    ADD with the same container ID since then (a new file) waits for a build that has it.
    Returns the attachments marked (``before``'s still programmed and the new ones).  Raises
    Busy, having changed nothing, if another process holds the lock (the agent tries again)."""
    directory = os.path.join(endpoints_dir(data_dir), PROGRAMMED)
    _make_dir(directory)
    marked = programmed & before
    new = programmed - before
    if new:
        with _locked(data_dir, exclusive=True):  # ADD unlinks and writes under the shared lock
            for cid, which in sorted(new):
                if _ident(data_dir, cid) != which:
                    continue  # gone, or replaced by a new attachment of the same container ID
                with open(os.path.join(directory, cid), "w"):
                    pass
                marked.add((cid, which))
    keep = {cid for cid, _ in programmed}
    for cid in {cid for cid, _ in before} - keep:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, cid))
    return marked


def _ident(data_dir: str | os.PathLike[str], container_id: str) -> str | None:
    """The container's endpoint file's ident (Endpoint.ident); None without the file (or
    unreadable: it is then no file the agent read)."""
    try:
        with open(os.path.join(endpoints_dir(data_dir), container_id + SUFFIX), encoding="utf-8") as f:
            st = os.fstat(f.fileno())
            return file_ident(Endpoint.from_json(f.read()).generation, st)
    except (OSError, ValueError, TypeError):
        return None


def unacknowledged(data_dir: str | os.PathLike[str], containers: set[str]) -> set[str]:
    """Those of ``containers`` no agent has marked programmed (their ADD may be waiting)."""
    directory = os.path.join(endpoints_dir(data_dir), PROGRAMMED)
    return {cid for cid in containers if not os.path.exists(os.path.join(directory, cid))}


# ------------------------------------------------------------------ the agent's side


def read_all(
    data_dir: str | os.PathLike[str], reported: set[str] | None = None, unreadable: set[str] | None = None
) -> dict[str, Endpoint]:
    """Every endpoint file, by container ID; unreadable ones are logged once and skipped (their
    container IDs, the files' names, added to ``unreadable``: such a file is still there).
    A file that is gone as it is read is just gone."""
    directory = endpoints_dir(data_dir)
    out: dict[str, Endpoint] = {}
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return out
    for name in names:
        if not name.endswith(SUFFIX) or name.startswith("."):
            continue
        path = os.path.join(directory, name)
        try:
            with open(path, encoding="utf-8") as f:
                st = os.fstat(f.fileno())
                ep = Endpoint.from_json(f.read())
                ep = replace(ep, written=st.st_mtime_ns, ident=file_ident(ep.generation, st))
        except FileNotFoundError:
            continue
        except (OSError, ValueError, TypeError) as err:
            if reported is None or path not in reported:
                log.warning("cannot read endpoint file %s: %s", path, err)
                if reported is not None:
                    reported.add(path)
            if unreadable is not None:
                unreadable.add(name[: -len(SUFFIX)])
            continue
        out[ep.container_id] = ep
    return out


def relabel(data_dir: str | os.PathLike[str], ep: Endpoint, labels: dict[str, str]) -> Endpoint | None:
    """Keep labels set later (``agentd label pod``) in the file, so they outlive the record.

    Only while the file is still the one ``ep`` was read from (its ident): None (and nothing
    written) if the pod's DEL removed it meanwhile -- rewriting it would bring the pod back for
    good -- or a new ADD of the same container ID replaced it.  The file keeps its generation
    (the same attachment).  Raises Busy, having written nothing, if another process holds the
    lock."""
    new = replace(ep, labels=dict(labels))
    path = os.path.join(endpoints_dir(data_dir), ep.container_id + SUFFIX)
    with _endpoints(data_dir, missing_ok=True) as fd:
        if fd is None:
            return None
        with _locked(data_dir, exclusive=True, dir_fd=fd):  # DEL removes, ADD writes, under the shared lock
            now = _ident(data_dir, ep.container_id)
            if now is None or (ep.ident and now != ep.ident):
                return None
            _replace(fd, new)
            if ep.written:  # the file keeps the time its pod was attached (see Endpoint.written)
                with contextlib.suppress(OSError):
                    os.utime(path, ns=(ep.written, ep.written))
            with contextlib.suppress(OSError):  # a file without a generation: its ident is the new inode's
                new = replace(new, ident=file_ident(new.generation, os.stat(path)))
    return new


# inotify(7), through libc: a change in the directory wakes the agent at once.
_IN_CLOSE_WRITE, _IN_MOVED_FROM, _IN_MOVED_TO, _IN_CREATE, _IN_DELETE = 0x8, 0x40, 0x80, 0x100, 0x200
_IN_NONBLOCK, _IN_CLOEXEC = 0o4000, 0o2000000


class DirectoryWatch:
    """Calls ``on_change`` when files in ``directory`` change (inotify; None if unavailable)."""

    def __init__(self, directory: str, on_change: Callable[[], None]) -> None:
        self.directory = directory
        self.on_change = on_change
        self._fd: int | None = None

    def start(self) -> bool:
        with contextlib.suppress(NotADirectoryError):  # a symlink (agentd-cni refuses it): read as it is
            _make_dir(self.directory)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
            if fd < 0:
                return False
            mask = _IN_CLOSE_WRITE | _IN_MOVED_FROM | _IN_MOVED_TO | _IN_CREATE | _IN_DELETE
            if libc.inotify_add_watch(fd, self.directory.encode(), mask) < 0:
                os.close(fd)
                return False
        except (OSError, AttributeError):
            return False
        self._fd = fd
        asyncio.get_running_loop().add_reader(fd, self._readable)
        return True

    def _readable(self) -> None:
        # The events are drained, not decoded: any change means "read the directory again".
        assert self._fd is not None
        try:
            while os.read(self._fd, 65536):
                pass
        except BlockingIOError:
            pass
        except OSError:
            return
        self.on_change()

    def stop(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._fd)
            os.close(self._fd)
            self._fd = None

