"""``[ingress] user``: HAProxy's workers switch to it, which its master (root, the agent's
child) may do only with CAP_SETUID and CAP_SETGID -- the shipped unit's bounding set has
neither.  The agent checks first, the way HAProxy will (a child of its own switches), and says
in one line what the node's drop-in must add, instead of a proxy whose workers die at start."""

import pwd
import subprocess
import sys

from agentd.ingress.proxy import RunAs, resolve_user

SCRIPT = r"""
import ctypes, sys
from agentd.ingress.proxy import ProxyError, resolve_user
libc = ctypes.CDLL(None, use_errno=True)
for cap in map(int, sys.argv[1:]):
    assert libc.prctl(24, cap, 0, 0, 0) == 0  # PR_CAPBSET_DROP: gone for this process's children
try:
    print("resolved", resolve_user("haproxy"))
except ProxyError as err:
    print(err)
"""
CAP_SETGID, CAP_SETUID = 6, 7


def test_the_user_is_checked_as_haproxy_will_switch_to_it():
    pw = pwd.getpwnam("haproxy")
    run_as = resolve_user("haproxy")
    assert isinstance(run_as, RunAs) and (run_as.uid, run_as.gid, run_as.user) == (pw.pw_uid, pw.pw_gid, "haproxy")
    for caps in ([CAP_SETUID], [CAP_SETGID]):
        out = subprocess.run([sys.executable, "-c", SCRIPT, *map(str, caps)], capture_output=True, text=True,
                             timeout=60, check=False)  # fmt: skip
        assert out.returncode == 0, out.stderr
        message = out.stdout.strip()
        assert message.startswith("HAProxy's workers cannot switch to [ingress] user haproxy (PermissionError"), message
        for needed in ("agentd.service.d/ingress.conf", "CapabilityBoundingSet=CAP_SETUID CAP_SETGID CAP_KILL",
                       "SystemCallFilter=@setuid", f"SupplementaryGroups={run_as.group}"):  # fmt: skip
            assert needed in message, message
        assert "\n" not in message
