"""``agentd-cni``: the node's CNI plugin (CNI spec 1.0.0), modelled on flannel's.

The container runtime runs this executable with ``CNI_COMMAND`` and friends in the environment
and the plugin's network config on stdin.  It reads the subnet file the agent wrote, builds a
config for the reference ``bridge`` plugin with ``host-local`` IPAM
(:func:`agentd.cni.netconf.delegate_config`), runs that plugin from ``CNI_PATH`` with the same
environment, and passes its result through.

* ADD stores the delegate config in ``<dataDir>/.state/<CNI_CONTAINERID>`` (a directory only
  root writes: see STATE_SUBDIR) *before* running the delegate, so the runtime's clean-up DEL
  after a failed ADD still knows what to undo, with the ``CNI_IFNAME`` it was for (key
  ``agentdIfname``, never passed on).  A container has one agentd interface: an ADD for a
  second ``CNI_IFNAME`` (Multus attaching agentd twice) is refused, and its clean-up DEL leaves
  the first attachment alone.  A state file that does not name its interface (an older
  agentd-cni's, or a damaged one) belongs to the interface its endpoint file names; with no
  endpoint file either, ADD is refused for any interface and DEL takes the file as its own (see
  :func:`attached_ifname`).
* DEL runs the delegate with exactly the stored config (the subnet file may have changed since),
  then removes it.  DEL is idempotent: with no stored config it falls back to a config built from
  the current subnet file (so host-local still releases the address), and with no subnet file
  either, or no delegate in ``CNI_PATH`` with no state file at all (ADD looks for it before it
  stores anything), there is nothing left to undo and DEL succeeds (with a warning on stderr
  for the missing delegate).  With a state file a missing delegate fails DEL: something may be
  left to undo.  A stored config that is empty or damaged is used as none (the current
  config), and DEL removes it once it has done its work (ADD writes it whole: a temporary
  file, fsynced, renamed).  A missing netns is handled by the bridge plugin (it releases the
  address and succeeds).  If the delegate rejects the stored config (an ADD with a broken
  config), DEL retries with the current config, so fixing the config ends the runtime's DEL
  retries.  DEL also removes the temporary files a crash left in dataDir
  (:func:`sweep_temp_files`); a state file whose DEL never comes stays.  A state file an
  older agentd-cni kept in dataDir itself is still found (see :func:`find_state`).
* CHECK runs the delegate with the stored config plus the runtime's ``prevResult``, then checks
  what the delegate cannot know: the pod's addresses are inside the node's subnets as the
  subnet file gives them now (a node that lost its lease has another), and the pod's endpoint
  file -- what the agent programs its network policy from -- is there with those addresses.
* VERSION prints the supported spec versions.

Plugin config keys (besides ``cniVersion``, ``name``, ``type``; paths are absolute): ``subnetFile`` (default
``/run/agentd/subnet.env``), ``dataDir`` (default ``/var/lib/agentd/cni``), ``binDir`` (more
directories to find the delegates in after ``CNI_PATH``: the agent's ``[cni] bin_dir``), ``ipam`` (merged
into the delegate's ipam, e.g. host-local's ``dataDir``), ``delegate`` (overrides for the
bridge plugin), ``delegateTimeout`` (seconds the delegate may run; default 60), ``policyTimeout``
(seconds ADD waits for the agent to program network policy for the pod; default 2, 0: no wait).

Errors are CNI error results on stdout (spec 1.0.0, "Error"), one line in ``msg``, and exit 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address, ip_address, ip_interface
from typing import Any

# Pod identity for NetworkPolicy: the endpoint file the agent picks up.
from agentd.cni import endpoints as pod_endpoints
from agentd.cni.netconf import (
    DEFAULT_DATA_DIR,
    DEFAULT_SUBNET_FILE,
    SubnetFile,
    SubnetFileError,
    delegate_config,
    read_subnet_file,
    dns_config,
)

SUPPORTED_VERSIONS = ("0.3.0", "0.3.1", "0.4.0", "1.0.0")
CURRENT_VERSION = "1.0.0"
DELEGATE_TIMEOUT = 60.0
MAX_DELEGATE_TIMEOUT = 3600.0

# Well-known error codes (CNI spec 1.0.0, "Error"); 999 is libcni's "internal" code, used by the
# reference plugins for every failure without a better code.
INCOMPATIBLE_CNI_VERSION = 1
UNKNOWN_CONTAINER = 3
INVALID_ENVIRONMENT_VARIABLES = 4
IO_FAILURE = 5
DECODING_FAILURE = 6
INVALID_NETWORK_CONFIG = 7
TRY_AGAIN_LATER = 11
INTERNAL = 999

# Container IDs and network names: libcni's utils.ValidateContainerID / ValidateNetworkName.
# The container ID also names the state file, so this keeps it inside dataDir.  Used with
# fullmatch: Python's "$" also matches before a final "\n" (Go's does not), so "abc\n" would pass.
_ID_RE = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.\-]*")
# ... but a file name has a limit (255 bytes; the temp files add a prefix and a suffix), and
# names dataDir holds for other things are not a container's (an ID "endpoints" would take the
# endpoint files' directory).  ADD and CHECK refuse such IDs; DEL takes them (nothing to undo
# but what an older plugin may have stored).
MAX_ID_BYTES = 200
RESERVED_IDS = frozenset({pod_endpoints.SUBDIR})
IFNAMSIZ = 16


class CniError(Exception):
    """A failure reported to the runtime as a CNI error result.

    ``result`` set means "print this exact object": a delegate's own error, passed through.
    """

    def __init__(self, code: int, msg: str, details: str = "", *, result: dict[str, Any] | None = None) -> None:
        super().__init__(msg)
        self.code = code
        self.msg = msg
        self.details = details
        self.result = result

    def to_result(self, cni_version: str) -> dict[str, Any]:
        if self.result is not None:
            return self.result
        return {"cniVersion": cni_version, "code": self.code, "msg": self.msg, "details": self.details}


class DelegateNotFound(CniError):
    """The delegate plugin is in no directory of CNI_PATH (nor binDir)."""


@dataclass(frozen=True)
class CmdArgs:
    """The runtime's parameters from the environment (spec 1.0.0, "Parameters")."""

    command: str
    container_id: str
    netns: str
    ifname: str
    path: tuple[str, ...]


def version_info() -> dict[str, Any]:
    return {"cniVersion": CURRENT_VERSION, "supportedVersions": list(SUPPORTED_VERSIONS)}


def handle(env: Mapping[str, str], stdin: bytes) -> tuple[int, dict[str, Any] | None]:
    """Run one CNI command; returns ``(exit code, object to print or None)``.  Never raises."""
    cni_version = _peek_version(stdin)
    try:
        command = env.get("CNI_COMMAND", "")
        if not command:
            raise CniError(INVALID_ENVIRONMENT_VARIABLES, "CNI_COMMAND is not set")
        if command == "VERSION":
            return 0, version_info()
        if command not in ("ADD", "DEL", "CHECK"):
            raise CniError(
                INVALID_ENVIRONMENT_VARIABLES,
                f"unknown CNI_COMMAND {_short(command)}",
                "expected ADD, DEL, CHECK or VERSION",
            )
        args = parse_env(command, env)
        netconf = parse_netconf(stdin)
        if netconf.get("binDir"):
            # The agent's [cni] bin_dir: where delegates are looked for after CNI_PATH.
            args = dataclasses.replace(args, path=args.path + tuple(p for p in netconf["binDir"] if p not in args.path))
        if command == "ADD":
            return 0, cmd_add(args, netconf, env)
        if command == "DEL":
            cmd_del(args, netconf, env)
            sweep_temp_files(_data_dir(netconf), time.time())
        else:
            cmd_check(args, netconf, env)
        return 0, None
    except CniError as e:
        return 1, e.to_result(cni_version)
    except Exception as e:  # noqa: BLE001 — the runtime must get a CNI error, never a traceback
        return 1, CniError(INTERNAL, f"internal error: {type(e).__name__}: {e}").to_result(cni_version)


def main() -> int:
    """The executable: ends quietly (no traceback) when the runtime closes our stdout (128 +
    SIGPIPE, what a shell reports for a tool that SIGPIPE killed) or on Ctrl-C (130).  The same
    rule as ``agentd``'s (agentd/cli.py), kept here because the plugin imports nothing of the agent."""
    try:
        try:
            stdin = sys.stdin.buffer.read() if sys.stdin is not None else b""
        except (OSError, ValueError):
            stdin = b""
        code, result = handle(os.environ, stdin)
        if result is not None:
            sys.stdout.write(json.dumps(result) + "\n")
            sys.stdout.flush()
        return code
    except BrokenPipeError:
        # Python's advice (signal module docs, "Note on SIGPIPE"): point stdout at /dev/null
        # so that the interpreter's last flush at exit does not fail once more.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE
    except KeyboardInterrupt:
        return 128 + signal.SIGINT


# --- input ---------------------------------------------------------------------------------


def parse_env(command: str, env: Mapping[str, str]) -> CmdArgs:
    """Validate the CNI_* variables ``command`` needs (as libcni's skel does)."""
    container_id = env.get("CNI_CONTAINERID", "")
    if not container_id:
        raise CniError(INVALID_ENVIRONMENT_VARIABLES, "CNI_CONTAINERID is not set")
    if not _ID_RE.fullmatch(container_id):
        raise CniError(
            INVALID_ENVIRONMENT_VARIABLES,
            f"invalid characters in CNI_CONTAINERID {_short(container_id)}",
            "must match ^[a-zA-Z0-9][a-zA-Z0-9_.-]*$",
        )
    if command != "DEL":
        if len(container_id) > MAX_ID_BYTES:
            raise CniError(
                INVALID_ENVIRONMENT_VARIABLES,
                f"CNI_CONTAINERID {_short(container_id)} is longer than {MAX_ID_BYTES} bytes",
                "it names this plugin's state file",
            )
        if container_id in RESERVED_IDS:
            raise CniError(
                INVALID_ENVIRONMENT_VARIABLES,
                f"CNI_CONTAINERID {_short(container_id)} is reserved",
                "it names a directory of this plugin's dataDir",
            )
    netns = env.get("CNI_NETNS", "")
    if not netns and command != "DEL":  # DEL may come after the namespace is gone
        raise CniError(INVALID_ENVIRONMENT_VARIABLES, "CNI_NETNS is not set")
    if netns and command != "DEL" and not os.path.exists(netns):
        # Checked before ADD stores anything: the delegate could not enter it anyway.
        raise CniError(INVALID_ENVIRONMENT_VARIABLES, f"CNI_NETNS {_short(netns, 256)} does not exist")
    ifname = env.get("CNI_IFNAME", "")
    if not ifname:
        raise CniError(INVALID_ENVIRONMENT_VARIABLES, "CNI_IFNAME is not set")
    problem = _ifname_problem(ifname)
    if problem:
        raise CniError(INVALID_ENVIRONMENT_VARIABLES, f"invalid CNI_IFNAME {_short(ifname)}: {problem}")
    path = tuple(p for p in env.get("CNI_PATH", "").split(os.pathsep) if p)
    if not path:
        raise CniError(INVALID_ENVIRONMENT_VARIABLES, "CNI_PATH is not set")
    return CmdArgs(command=command, container_id=container_id, netns=netns, ifname=ifname, path=path)


def _ifname_problem(ifname: str) -> str:
    # libcni's utils.ValidateInterfaceName: the kernel's rules for a link name.  The kernel
    # counts bytes (IFNAMSIZ includes the NUL), not characters.
    try:
        size = len(os.fsencode(ifname))
    except UnicodeEncodeError:
        return "not valid text"
    if size > IFNAMSIZ - 1:
        return f"longer than {IFNAMSIZ - 1} bytes"
    if ifname in (".", ".."):
        return "not a valid name"
    for c in ifname:
        if c in "/:" or c.isspace():
            return f"contains {c!r}"
    return ""


def parse_netconf(stdin: bytes) -> dict[str, Any]:
    """Decode and check the network config; returns it as a dict (unchanged)."""
    if not stdin.strip():
        raise CniError(DECODING_FAILURE, "no network config on stdin")
    try:
        conf = json.loads(stdin)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CniError(DECODING_FAILURE, f"network config on stdin is not JSON: {e}") from None
    except RecursionError:
        raise CniError(DECODING_FAILURE, "network config on stdin is nested too deeply") from None
    except ValueError:  # an integer with more digits than Python converts (sys.get_int_max_str_digits)
        raise CniError(DECODING_FAILURE, "network config on stdin has a number too long to decode") from None
    if not isinstance(conf, dict):
        raise CniError(DECODING_FAILURE, f"network config must be a JSON object, not {type(conf).__name__}")

    if "cniVersion" not in conf:
        # Configs without a version are 0.1.0 by convention, which this plugin does not speak.
        raise CniError(
            INCOMPATIBLE_CNI_VERSION,
            "network config has no cniVersion",
            f"plugin supports {list(SUPPORTED_VERSIONS)}",
        )
    version = conf["cniVersion"]
    if not isinstance(version, str):
        raise CniError(INVALID_NETWORK_CONFIG, f"cniVersion must be a string, not {_short(version)}")
    if version not in SUPPORTED_VERSIONS:
        raise CniError(
            INCOMPATIBLE_CNI_VERSION,
            "incompatible CNI versions",
            f"config is {_short(version)}, plugin supports {list(SUPPORTED_VERSIONS)}",
        )

    name = conf.get("name")
    if not isinstance(name, str) or not name:
        raise CniError(INVALID_NETWORK_CONFIG, "network config needs a string 'name'")
    if not _ID_RE.fullmatch(name):
        raise CniError(INVALID_NETWORK_CONFIG, f"invalid characters in network name {_short(name)}")
    for key in ("type", "subnetFile", "dataDir"):
        if key in conf and (not isinstance(conf[key], str) or not conf[key]):
            raise CniError(INVALID_NETWORK_CONFIG, f"'{key}' must be a non-empty string")
    for key in ("subnetFile", "dataDir"):  # a NUL would fail at the first open(), as "internal error"
        if key in conf and (not os.path.isabs(conf[key]) or "\x00" in conf[key]):
            raise CniError(INVALID_NETWORK_CONFIG, f"'{key}' must be an absolute path, not {_short(conf[key], 200)}")
    bin_dir = conf.get("binDir", [])
    if not isinstance(bin_dir, list) or not all(isinstance(d, str) and os.path.isabs(d) and "\x00" not in d for d in bin_dir):
        raise CniError(INVALID_NETWORK_CONFIG, "'binDir' must be an array of absolute directory paths")

    delegate = conf.get("delegate", {})
    if not isinstance(delegate, dict):
        raise CniError(INVALID_NETWORK_CONFIG, "'delegate' must be an object")
    if "type" in delegate:
        _check_plugin_name(delegate["type"], "'delegate.type'")
    for key in ("name", "ipam"):  # flannel's rule: these come from the plugin, not the delegate
        if key in delegate:
            raise CniError(
                INVALID_NETWORK_CONFIG,
                f"'delegate' must not set '{key}'; agentd-cni sets it"
                + (" (put IPAM settings in the plugin's own 'ipam')" if key == "ipam" else ""),
            )

    ipam = conf.get("ipam", {})
    if not isinstance(ipam, dict):
        raise CniError(INVALID_NETWORK_CONFIG, "'ipam' must be an object")
    for key in ("subnet", "ranges"):
        if key in ipam:
            raise CniError(
                INVALID_NETWORK_CONFIG, f"'ipam.{key}' must not be set; the node subnet comes from the subnet file"
            )
    if "type" in ipam:
        _check_plugin_name(ipam["type"], "'ipam.type'")
    routes = ipam.get("routes", [])
    if not isinstance(routes, list) or not all(isinstance(r, dict) and isinstance(r.get("dst"), str)
                                               for r in routes):
        raise CniError(INVALID_NETWORK_CONFIG, "'ipam.routes' must be a list of objects with a string 'dst'")

    timeout = conf.get("delegateTimeout", DELEGATE_TIMEOUT)
    # Comparing rejects NaN, infinities and huge integers too (json reads 1e999 as inf).
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_DELEGATE_TIMEOUT:
        raise CniError(
            INVALID_NETWORK_CONFIG,
            f"'delegateTimeout' must be a number of seconds in (0, {MAX_DELEGATE_TIMEOUT:g}], not {_short(timeout)}",
        )
    wait = conf.get("policyTimeout", 2.0)
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 60:
        raise CniError(INVALID_NETWORK_CONFIG, f"'policyTimeout' must be a number of seconds in [0, 60], not {_short(wait)}")
    if "prevResult" in conf and not isinstance(conf["prevResult"], dict):
        raise CniError(INVALID_NETWORK_CONFIG, "'prevResult' must be an object")
    return conf


def _short(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters for a one-line message."""
    try:
        text = repr(value)
    except ValueError:  # an int too long for str()
        return f"<{type(value).__name__} too long>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_plugin_name(value: Any, what: str) -> str:
    # The spec: a plugin type must not contain characters a file name cannot (/ or \).
    if not isinstance(value, str) or not value or value in (".", "..") or "/" in value or "\\" in value:
        raise CniError(INVALID_NETWORK_CONFIG, f"{what} must be a plugin name, not {_short(value)}")
    return value


def _peek_version(stdin: bytes) -> str:
    """The request's cniVersion for error results, if it is one we speak."""
    try:
        version = json.loads(stdin).get("cniVersion")
    except Exception:  # noqa: BLE001 — anything undecodable is reported later
        return CURRENT_VERSION
    return version if version in SUPPORTED_VERSIONS else CURRENT_VERSION


# --- commands ------------------------------------------------------------------------------


def cmd_add(args: CmdArgs, netconf: dict[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    sf = load_subnet_file(netconf.get("subnetFile", DEFAULT_SUBNET_FILE))
    conf = delegate_config(netconf, sf)
    pod = _pod_identity(args, env, netconf, adding=True)  # checked before anything is set up
    data_dir = _data_dir(netconf)
    if _state_file_exists(data_dir, args.container_id):
        attached = attached_ifname(data_dir, args.container_id)
        if attached != args.ifname:
            # A state file whose interface nothing names (an older agentd-cni's, without the
            # name, and no endpoint file; or a damaged one) may be any interface's: overwriting
            # it would take the attachment's config (and its endpoint file) from its own DEL.
            raise CniError(
                INVALID_NETWORK_CONFIG,
                f"container {args.container_id} already has an agentd interface "
                f"({attached or 'its name not stored'}); agentd attaches a container once, not again as {args.ifname}",
                "" if attached else "the state file is an older agentd-cni's or damaged; DEL the container first",
            )
    # Looked for before anything is stored: an ADD that cannot run its delegate has set up
    # nothing, so its clean-up DEL finds nothing stored and has nothing to undo.
    find_plugin(conf["type"], args.path)
    save_state(data_dir, args.container_id, conf, args.ifname)
    result = invoke_delegate(conf, args, env, timeout=netconf.get("delegateTimeout", DELEGATE_TIMEOUT))
    if result is None:
        raise CniError(INTERNAL, f"delegate {conf['type']} printed no result for ADD")
    if pod is not None:
        _record_endpoint(args, netconf, conf, pod, result, env)
    dns = dns_config(sf, pod[0] if pod is not None else None)  # Services: the pod namespace
    if dns is not None and not result.get("dns", {}).get("nameservers"):
        result["dns"] = dns
    return result


# --- pod identity for NetworkPolicy (agentd/cni/endpoints.py) -------------------------------


def _pod_identity(args: CmdArgs, env: Mapping[str, str], netconf: dict[str, Any], *, adding: bool = False) -> Any:
    """The pod's identity (endpoints.identity); ``adding``: ADD, which alone caps its labels."""

    def warn(why: str) -> None:
        print(f"agentd-cni: container {args.container_id} is attached without pod identity "
              f"(network policy neither selects nor isolates it): {why}", file=sys.stderr)

    try:
        return pod_endpoints.identity(env, netconf, warn, adding=adding)
    except pod_endpoints.EndpointError as e:
        raise CniError(INVALID_NETWORK_CONFIG, f"pod identity: {e}") from None


def _record_endpoint(args: CmdArgs, netconf: dict[str, Any], conf: dict[str, Any], pod: Any, result: dict[str, Any],
                     env: Mapping[str, str]) -> None:
    """Leave the endpoint file for the agent (a failure fails ADD: the runtime then runs DEL)."""
    namespace, name, labels, ports = pod
    try:
        ips, interface, mac = pod_endpoints.attachment(result, conf.get("bridge", "cni0"))
        pod_endpoints.write(
            _data_dir(netconf),
            pod_endpoints.Endpoint(
                container_id=args.container_id, namespace=namespace, name=name, labels=labels, ports=ports,
                ips=ips, interface=interface, mac=mac, bridge=conf.get("bridge", "cni0"),
                ifname=args.ifname, netns=args.netns, pod_mac=pod_endpoints.pod_mac(result, args.ifname, env, netconf),
            ),
        )  # fmt: skip
    except pod_endpoints.EndpointError as e:
        raise CniError(INTERNAL, f"pod identity: {e}") from None
    except OSError as e:  # (endpoints/ or its .programmed a symlink: refused)
        where = f"{e.filename}: " if e.filename else ""
        raise CniError(IO_FAILURE, f"cannot write the endpoint file for {namespace}/{name}: {where}{e.strerror or e}") from None
    wait = netconf.get("policyTimeout", pod_endpoints.DEFAULT_WAIT)
    if wait and not pod_endpoints.wait_programmed(_data_dir(netconf), args.container_id, wait):
        print(f"agentd-cni: the agent has not programmed network policy for {namespace}/{name} within {wait:g} s "
              "(is agentd running?); the pod starts anyway", file=sys.stderr)


def cmd_del(args: CmdArgs, netconf: dict[str, Any], env: Mapping[str, str]) -> None:
    data_dir = _data_dir(netconf)
    timeout = netconf.get("delegateTimeout", DELEGATE_TIMEOUT)
    attached = attached_ifname(data_dir, args.container_id)
    if attached is not None and attached != args.ifname:
        # The clean-up DEL of a refused second attachment: the first one is not this DEL's.
        print(f"agentd-cni: container {args.container_id} has its agentd interface as {attached}, "
              f"not {args.ifname}: nothing to undo", file=sys.stderr)
        return
    stored = load_state(data_dir, args.container_id)
    current = _current_delegate_config(netconf)
    if stored is None:
        # Nothing stored (never added, already deleted, or the state was lost).  Let the delegate
        # release whatever is left under the current config; if the agent has not written a
        # usable subnet file either, there is nothing this plugin can undo.
        if current is not None:
            try:
                invoke_delegate(current, args, env, timeout=timeout)
            except DelegateNotFound as e:
                # No state file at all and no delegate to ask: nothing this plugin could undo
                # (ADD looks for the delegate before it stores anything).  Failing would fail
                # every DEL of this container for ever (spec 1.0.0: DEL must succeed when there
                # is nothing to undo).  A state file it cannot read (empty, damaged) says ADD got
                # past that look, so the delegate may have set things up: DEL fails, the file
                # kept, until the delegate is back (a plugins package being upgraded).
                if _state_file_exists(data_dir, args.container_id):
                    raise
                print(f"agentd-cni: DEL of container {args.container_id}: {e.msg}; no config stored, "
                      "so nothing to undo", file=sys.stderr)
        # A state file load_state could not use (empty or damaged: a crash, a full disk; or one
        # another user could have put there) names nothing to undo; this DEL has done what it
        # can, so it goes, or it would stay for ever.
        remove_state(data_dir, args.container_id)
        _remove_endpoint(data_dir, args.container_id)
        return
    try:
        invoke_delegate(stored, args, env, timeout=timeout)
    except CniError as stored_failed:
        # A stored config the delegate rejects would fail every DEL forever (the runtime retries
        # DEL until it succeeds).  Once the network config has been fixed, undo with that.
        if current is None or current == stored:
            raise
        print(
            f"agentd-cni: DEL with the stored config failed ({stored_failed.msg}); retrying with the current one",
            file=sys.stderr,
        )
        try:
            invoke_delegate(current, args, env, timeout=timeout)
        except CniError:
            raise stored_failed from None
    remove_state(data_dir, args.container_id)
    # Only now: the file gone takes the pod out of the policy tables (open), and a DEL that
    # failed above leaves the pod as it was until the runtime retries.  A DEL stopped between
    # the delegate (address released) and here leaves a stale file; the agent gives the address
    # to the newer of two files claiming it (PolicyEngine.conflicts).
    _remove_endpoint(data_dir, args.container_id)


def _remove_endpoint(data_dir: str, container_id: str) -> None:
    try:
        pod_endpoints.remove(data_dir, container_id)
    except OSError as e:  # endpoints/ or its .programmed a symlink (refused), an I/O error
        where = e.filename or pod_endpoints.endpoints_dir(data_dir)
        raise CniError(IO_FAILURE, f"cannot remove the endpoint file of container {container_id}: {where}: "
                                   f"{e.strerror or e}") from None


def _current_delegate_config(netconf: dict[str, Any]) -> dict[str, Any] | None:
    """The delegate config ADD would use now, or None without a usable subnet file."""
    try:
        sf = load_subnet_file(netconf.get("subnetFile", DEFAULT_SUBNET_FILE))
    except CniError:
        return None
    return delegate_config(netconf, sf)


def cmd_check(args: CmdArgs, netconf: dict[str, Any], env: Mapping[str, str]) -> None:
    # CHECK arrived with spec 0.4.0; the runtime must send the result of the ADD as prevResult.
    if _version_tuple(netconf["cniVersion"]) < (0, 4, 0):
        raise CniError(
            INCOMPATIBLE_CNI_VERSION,
            "config version does not allow CHECK",
            f"CHECK needs cniVersion 0.4.0 or later, config is {netconf['cniVersion']!r}",
        )
    if "prevResult" not in netconf:
        raise CniError(INVALID_NETWORK_CONFIG, "CHECK needs 'prevResult' (the result of ADD) in the config")
    data_dir = _data_dir(netconf)
    stored = load_state(data_dir, args.container_id)
    attached = attached_ifname(data_dir, args.container_id)
    if stored is None or (attached is not None and attached != args.ifname):
        raise CniError(
            UNKNOWN_CONTAINER,
            f"no delegate config stored for container {args.container_id} interface {args.ifname}",
            "was it added?",
        )
    conf = dict(stored, cniVersion=netconf["cniVersion"], prevResult=netconf["prevResult"])
    invoke_delegate(conf, args, env, timeout=netconf.get("delegateTimeout", DELEGATE_TIMEOUT))
    ips = _result_addresses(netconf["prevResult"])
    _check_in_subnets(ips, load_subnet_file(netconf.get("subnetFile", DEFAULT_SUBNET_FILE)))
    if _pod_identity(args, env, netconf) is not None:
        _check_endpoint(data_dir, args.container_id, ips)


def _result_addresses(result: Any) -> list[IPv4Address | IPv6Address]:
    """The pod addresses of a result (``prevResult``), checked as addresses."""
    entries = result.get("ips") if isinstance(result, dict) else None
    if not isinstance(entries, list) or not entries:
        raise CniError(INVALID_NETWORK_CONFIG, "CHECK: prevResult names no address ('ips')")
    out = []
    for entry in entries:
        text = entry.get("address") if isinstance(entry, dict) else None
        try:
            out.append(ip_interface(str(text)).ip)
        except ValueError:
            raise CniError(INVALID_NETWORK_CONFIG, f"CHECK: prevResult address {_short(text)} is not an address") from None
    return out


def _check_in_subnets(ips: list[IPv4Address | IPv6Address], sf: SubnetFile) -> None:
    """Each address inside this node's pod subnet of its family, as the subnet file says now."""
    for ip in ips:
        subnet = sf.subnet if ip.version == 4 else sf.subnet_v6
        if subnet is None or ip not in subnet:
            raise CniError(
                INTERNAL,
                f"pod address {ip} is outside this node's IPv{ip.version} pod subnet ({subnet or 'none'})",
                "the node's subnet changed since the pod was added (a lost lease); the pod must be added again",
            )


def _check_endpoint(data_dir: str, container_id: str, ips: list[IPv4Address | IPv6Address]) -> None:
    """The endpoint file the agent programs the pod's network policy from: there, with these
    addresses."""
    ep = pod_endpoints.read(data_dir, container_id)
    if ep is None:
        raise CniError(
            INTERNAL, f"the endpoint file of container {container_id} is missing or unreadable",
            "the agent cannot program network policy for the pod; the pod must be added again",
        )
    if {ip_address(a) for a in ep.ips} != set(ips):
        raise CniError(
            INTERNAL,
            f"the endpoint file of container {container_id} names {', '.join(ep.ips)}, "
            f"not the pod's {', '.join(map(str, ips))}",
        )


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def _data_dir(netconf: dict[str, Any]) -> str:
    return netconf.get("dataDir", DEFAULT_DATA_DIR)


def load_subnet_file(path: str) -> SubnetFile:
    try:
        return read_subnet_file(path)
    except FileNotFoundError:
        raise CniError(
            TRY_AGAIN_LATER, f"subnet file {path} does not exist yet", "is agentd running on this node?"
        ) from None
    except SubnetFileError as e:
        raise CniError(INVALID_NETWORK_CONFIG, str(e)) from None


# --- stored delegate configs (flannel's "scratch netconf") -----------------------------------
#
# Root runs what a state file names (DEL, CHECK), so no other user may be able to write one.
# dataDir need not be root's: an agent of a user of its own makes it (docs/operations.md), and
# its user may rename, replace and unlink what is in it.  So the state files are in a directory
# of the plugin's own in dataDir, STATE_SUBDIR: made by the plugin (root's, 0700), and trusted
# only while it is still a directory (not a symlink), the plugin's user's (root's, under the
# runtime), writable by no group or other user -- else every command fails (IO_FAILURE) until
# the operator has seen to it.  Its name begins with a dot: no container ID can be it.
#
# An agentd-cni before it kept a container's state file in dataDir itself, dataDir/<ID>.  A DEL
# or CHECK of such a container still finds it there (when there is none in STATE_SUBDIR), but
# uses it only when no other user could have put it there: dataDir the plugin's user's and
# writable by no group or other user (how older plugins made it; and how the agent makes it
# when it runs as root) and the file a regular one (opened without following a symlink, never
# waiting on a FIFO), the plugin's user's, writable by no group or other user, of one link.
# Otherwise -- dataDir of an agent's own user, as the previous agentd-cni left it -- the file is
# taken as none (a warning on stderr): DEL undoes with the current config, as for a container
# with nothing stored, and removes it.

STATE_SUBDIR = ".state"
STATE_DIR_MODE = 0o700
STATE_MODE = 0o600
_STATE_HINT = ("it holds the delegate configs agentd-cni runs as root: only root may write it "
               "(chown root:root, chmod 0700; docs/operations.md)")


def state_dir(data_dir: str) -> str:
    return os.path.join(data_dir, STATE_SUBDIR)


def state_path(data_dir: str, container_id: str) -> str:
    return os.path.join(state_dir(data_dir), container_id)


def old_state_path(data_dir: str, container_id: str) -> str:
    """Where an agentd-cni before STATE_SUBDIR kept the container's state file."""
    return os.path.join(data_dir, container_id)


def private_problem(st: os.stat_result, euid: int, *, directory: bool) -> str:
    """Why a state directory (``directory``) or state file with this lstat/fstat result may hold
    what another user than ``euid`` (the plugin's: root, under the runtime) wrote; "" if it
    cannot: a directory (a regular file of one link: no hard link to a file elsewhere), owned
    by ``euid``, writable by no group or other user.  A symlink is neither."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink"
    if directory and not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if not directory and not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != euid:
        return f"is owned by uid {st.st_uid}, not {euid}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by its group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    if not directory and st.st_nlink != 1:
        return f"has {st.st_nlink} links"
    return ""


def _open_data_dir(data_dir: str) -> int | None:
    """dataDir, open (the operator's path: a symlink to it is followed); None if it is not there."""
    try:
        return os.open(data_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise CniError(IO_FAILURE, f"cannot open dataDir {data_dir}: {e.strerror or e}") from None


def _open_state_dir(data_fd: int, data_dir: str, *, create: bool) -> int | None:
    """STATE_SUBDIR of dataDir (``data_fd``), open and checked (see above); None if it is not
    there (``create``: made, STATE_DIR_MODE).  CniError (IO_FAILURE) for one another user could
    have written in."""
    path = state_dir(data_dir)
    made = False
    if create:
        try:
            os.mkdir(STATE_SUBDIR, STATE_DIR_MODE, dir_fd=data_fd)
            made = True
        except FileExistsError:
            pass
        except OSError as e:
            raise CniError(IO_FAILURE, f"cannot make {path}: {e.strerror or e}") from None
    try:
        fd = pod_endpoints.open_directory(STATE_SUBDIR, data_fd, shown=path)
    except FileNotFoundError:
        if create:
            raise CniError(IO_FAILURE, f"{path} went as it was made") from None
        return None
    except NotADirectoryError:
        raise CniError(IO_FAILURE, f"{path} is a symlink or no directory: refused", _STATE_HINT) from None
    except OSError as e:
        raise CniError(IO_FAILURE, f"cannot open {path}: {e.strerror or e}") from None
    try:
        if made:
            os.fchmod(fd, STATE_DIR_MODE)  # mkdir's mode is masked by the umask
        problem = private_problem(os.fstat(fd), os.geteuid(), directory=True)
    except BaseException:
        os.close(fd)
        raise
    if problem:
        os.close(fd)
        raise CniError(IO_FAILURE, f"the state directory {path} {problem}: refused", _STATE_HINT)
    return fd


@dataclass(frozen=True)
class StoredState:
    """A container's state file as found: ``data`` its content, or None when it is not to be
    used (``why``: another user could have put it there)."""

    path: str
    data: bytes | None
    why: str = ""


def find_state(data_dir: str, container_id: str) -> StoredState | None:
    """The container's state file: in STATE_SUBDIR, else where an older agentd-cni kept it
    (see above); None if there is none (a directory of the ID's name, an ID too long for a
    file name, no dataDir: none either).  CniError (IO_FAILURE) for a state directory another
    user could have written in, or a file that cannot be read."""
    data_fd = _open_data_dir(data_dir)
    if data_fd is None:
        return None
    try:
        state_fd = _open_state_dir(data_fd, data_dir, create=False)
        if state_fd is not None:
            try:
                found = _read_state_file(state_fd, container_id, state_path(data_dir, container_id), "")
            finally:
                os.close(state_fd)
            if found is not None:
                return found
        problem = private_problem(os.fstat(data_fd), os.geteuid(), directory=True)
        where = f"dataDir {data_dir} {problem}: another user could have put it there" if problem else ""
        return _read_state_file(data_fd, container_id, old_state_path(data_dir, container_id), where)
    finally:
        os.close(data_fd)


def _read_state_file(dir_fd: int, container_id: str, path: str, where: str) -> StoredState | None:
    """The state file ``container_id`` in the directory ``dir_fd`` (``path``), if it is one;
    ``where``: why the directory cannot be trusted ("" if it can)."""
    try:
        fd = os.open(container_id, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ENAMETOOLONG:  # no file can have this name: nothing was stored
            return None
        if e.errno == errno.ELOOP:
            return StoredState(path, None, "it is a symlink")
        raise CniError(IO_FAILURE, f"cannot read stored delegate config {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            return None  # a directory: an ID that names one ("endpoints": only DEL takes such IDs)
        problem = private_problem(st, os.geteuid(), directory=False)
        if problem or where:
            return StoredState(path, None, f"it {problem}" if problem else where)
        with os.fdopen(os.dup(fd), "rb") as f:
            return StoredState(path, f.read())
    except OSError as e:
        raise CniError(IO_FAILURE, f"cannot read stored delegate config {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)


IFNAME_KEY = "agentdIfname"  # in the stored config: the CNI_IFNAME it was stored for


def save_state(data_dir: str, container_id: str, conf: dict[str, Any], ifname: str | None = None) -> None:
    path = state_path(data_dir, container_id)
    if ifname is not None:
        conf = dict(conf, **{IFNAME_KEY: ifname})
    try:
        # dataDir 0755, not root's alone: the agent, maybe of a user of its own, reads endpoints/
        # in it.  The state files are in STATE_SUBDIR, STATE_MODE.
        pod_endpoints.make_data_dir(data_dir)
        data_fd = os.open(data_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            state_fd = _open_state_dir(data_fd, data_dir, create=True)
            assert state_fd is not None
            try:
                pod_endpoints.replace_at(state_fd, container_id, json.dumps(conf).encode(), STATE_MODE,
                                         f".{container_id}.")
            finally:
                os.close(state_fd)
        finally:
            os.close(data_fd)
    except OSError as e:
        raise CniError(IO_FAILURE, f"cannot store delegate config {path}: {e.strerror or e}") from None


def _trusted(found: StoredState | None) -> bytes | None:
    """The content of a state file found, if it is one to use; a warning on stderr if not."""
    if found is None:
        return None
    if found.data is None:
        print(f"agentd-cni: not using the stored delegate config {found.path}: {found.why}", file=sys.stderr)
    return found.data


def load_state(data_dir: str, container_id: str) -> dict[str, Any] | None:
    """The stored delegate config, or None if there is none (or it is unreadable as a config, or
    one another user could have put there)."""
    found = find_state(data_dir, container_id)
    data = _trusted(found)
    if found is None or data is None:
        return None
    try:
        conf = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, ValueError):
        conf = None
    if not isinstance(conf, dict) or not isinstance(conf.get("type"), str):
        print(f"agentd-cni: ignoring corrupt stored delegate config {found.path}", file=sys.stderr)
        return None
    conf.pop(IFNAME_KEY, None)
    return conf


def stored_ifname(data_dir: str, container_id: str) -> str | None:
    """The ``CNI_IFNAME`` the container's stored config is for; None without one (nothing
    stored, or stored by a plugin before it kept the name, or a file not to be used)."""
    found = find_state(data_dir, container_id)
    if found is None or found.data is None:
        return None
    try:
        conf = json.loads(found.data)
    except (ValueError, RecursionError):
        return None
    ifname = conf.get(IFNAME_KEY) if isinstance(conf, dict) else None
    return ifname if isinstance(ifname, str) else None


def attached_ifname(data_dir: str, container_id: str) -> str | None:
    """The ``CNI_IFNAME`` of the container's agentd attachment: the one its state file keeps,
    else (a state file of an older agentd-cni, without it, or a damaged one) the one its
    endpoint file names -- endpoint files have named it from the first; None if neither does
    (a container without pod identity, or an ADD stopped before it wrote the endpoint file).

    With None, DEL takes the state file as this interface's: only its DEL would ever remove
    it.  The delegate's DEL touches only what it keyed by ``CNI_IFNAME`` (host-local's lease,
    the link in the sandbox), so it undoes nothing of another interface; what such a DEL can
    take from the attachment is its stored config, and then the attachment's own DEL undoes
    with the current config, as for any container with nothing stored."""
    ifname = stored_ifname(data_dir, container_id)
    if ifname is None and _state_file_exists(data_dir, container_id):
        ep = pod_endpoints.read(data_dir, container_id)
        if ep is not None and ep.container_id == container_id and isinstance(ep.ifname, str) and ep.ifname:
            ifname = ep.ifname
    return ifname


# The temporary files save_state and endpoints.write (and the agent's relabel) make: mkstemp's
# names, ".<container ID>." and 8 of tempfile's name characters.  A crash between mkstemp and
# the rename leaves one, which no one else would ever remove.
_TEMP_RE = re.compile(r"\.[a-zA-Z0-9][a-zA-Z0-9_.\-]*\.[a-z0-9_]{8}")
TEMP_MAX_AGE = 600.0  # seconds: a temporary file this old is no write still going on


def sweep_temp_files(data_dir: str, now: float, max_age: float = TEMP_MAX_AGE) -> list[str]:
    """Remove the temporary files a crash left in ``data_dir``, its state directory and its
    endpoint directory: regular files named as this plugin's temporary files, not changed for
    ``max_age`` seconds before ``now``.  DEL runs it (any container's DEL: the one whose ADD
    crashed may never come).  Never fails: what it cannot list or remove stays.  Returns the
    paths removed.  Names are looked at and removed in each directory as opened (the state and
    endpoint directories never through a symlink in their place).

    Only temporary files: a state or endpoint file whose DEL never came (a node rebooted with
    its sandboxes gone, a runtime that lost its DEL) stays, as does its host-local lease --
    nothing here can tell a container that is gone from one that is not."""
    removed: list[str] = []
    try:
        data_fd = os.open(data_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return removed
    opened = [(data_fd, data_dir)]
    try:
        for sub in (STATE_SUBDIR, pod_endpoints.SUBDIR):
            with contextlib.suppress(OSError):
                opened.append((pod_endpoints.open_directory(sub, data_fd), os.path.join(data_dir, sub)))
        for dir_fd, directory in opened:
            try:
                names = os.listdir(dir_fd)
            except OSError:
                continue
            for name in names:
                if not _TEMP_RE.fullmatch(name):
                    continue
                try:
                    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                    if not stat.S_ISREG(st.st_mode) or now - st.st_mtime < max_age:
                        continue
                    os.unlink(name, dir_fd=dir_fd)
                except OSError:
                    continue
                removed.append(os.path.join(directory, name))
    finally:
        for dir_fd, _ in opened:
            os.close(dir_fd)
    if removed:
        print(f"agentd-cni: removed {len(removed)} temporary file(s) left by a crash: {', '.join(removed)}",
              file=sys.stderr)
    return removed


def _state_file_exists(data_dir: str, container_id: str) -> bool:
    """Whether the container has a state file to use (a regular file, damaged or not; a
    directory of that name, an ID such as "endpoints", is none, and so is a file another user
    could have put there: see find_state)."""
    found = find_state(data_dir, container_id)
    return found is not None and found.data is not None


def remove_state(data_dir: str, container_id: str) -> None:
    """The container's state file goes, from the state directory and from dataDir itself (an
    older agentd-cni's place; a file there that was not used goes too).  None is nothing to
    do; one that cannot be removed is a warning (the delegate's DEL succeeded: harmless)."""
    data_fd = _open_data_dir(data_dir)
    if data_fd is None:
        return
    opened = [(data_fd, old_state_path(data_dir, container_id))]
    try:
        with contextlib.suppress(OSError):
            opened.append((pod_endpoints.open_directory(STATE_SUBDIR, data_fd), state_path(data_dir, container_id)))
        for dir_fd, path in opened:
            try:
                os.unlink(container_id, dir_fd=dir_fd)
            except (FileNotFoundError, IsADirectoryError):
                pass  # a directory: an ID that names one, no state file
            except OSError as e:
                if e.errno != errno.ENAMETOOLONG:  # no file can have this name
                    print(f"agentd-cni: cannot remove {path}: {e.strerror or e}", file=sys.stderr)
    finally:
        for dir_fd, _ in opened:
            os.close(dir_fd)


# --- running the delegate ------------------------------------------------------------------


def find_plugin(plugin_type: str, path: tuple[str, ...]) -> str:
    _check_plugin_name(plugin_type, "delegate type")
    for directory in path:
        candidate = os.path.join(directory, plugin_type)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    searched = os.pathsep.join(path)
    if len(searched) > 200:
        searched = searched[:197] + "..."
    raise DelegateNotFound(INTERNAL, f"delegate plugin {_short(plugin_type)} not found in CNI_PATH {searched}")


def invoke_delegate(
    conf: dict[str, Any], args: CmdArgs, env: Mapping[str, str], *, timeout: float
) -> dict[str, Any] | None:
    """Run the delegate plugin with our environment and ``conf`` on stdin.

    Returns its result (ADD), or None when it printed nothing (DEL, CHECK).  A delegate that
    fails with a CNI error has that error passed through unchanged.
    """
    plugin_type = conf["type"]
    exe = find_plugin(plugin_type, args.path)
    try:
        # Own session, so a hung delegate and anything it started can be killed as a group.
        proc = subprocess.Popen(
            [exe],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            # The delegate finds its own IPAM plugin through CNI_PATH: give it ours, binDir included.
            env={**env, "CNI_PATH": os.pathsep.join(args.path)},
            start_new_session=True,
        )
    except OSError as e:
        raise CniError(INTERNAL, f"cannot run delegate {exe}: {e.strerror or e}") from None
    try:
        out, err = proc.communicate(json.dumps(conf).encode(), timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise CniError(
            INTERNAL, f"delegate {plugin_type} did not finish {args.command} within {timeout:g} s", "killed"
        ) from None
    if err:
        sys.stderr.write(err.decode(errors="replace"))

    if proc.returncode != 0:
        passthrough = _json_object(out)
        if passthrough is not None and "code" in passthrough:
            raise CniError(INTERNAL, str(passthrough.get("msg", "")), result=passthrough)
        how = f"was killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exited {proc.returncode}"
        last = (err or out).decode(errors="replace").strip().splitlines()
        raise CniError(INTERNAL, f"delegate {plugin_type} {how} during {args.command}", last[-1] if last else "")
    if not out.strip():
        return None
    result = _json_object(out)
    if result is None:
        raise CniError(INTERNAL, f"delegate {plugin_type} printed a result that is not a JSON object")
    return result


def _json_object(data: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None
