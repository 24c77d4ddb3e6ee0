"""The shipped unit forbids writable+executable memory (MemoryDenyWriteExecute=yes), which
HAProxy's regular-expression JIT needs: under that restriction -- the kernel's PR_SET_MDWE here,
inherited by HAProxy as systemd's is -- the proxy's configuration check fails, and the error
says why and what to add (the drop-in), instead of HAProxy's own "jit compilation failed"."""

import subprocess
import sys

from agentd.ingress.proxy import writable_executable_denied

SCRIPT = r"""
import asyncio, ctypes, sys
from agentd.ingress.proxy import Proxy, ProxyError, writable_executable_denied
cfg = sys.argv[1]
before = writable_executable_denied()
assert ctypes.CDLL(None, use_errno=True).prctl(65, 1, 0, 0, 0) == 0  # PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN
after = writable_executable_denied()
try:
    asyncio.run(Proxy(None).check(cfg))
    print(before, after, "accepted")
except ProxyError as err:
    print(before, after, err)
"""

CONFIG = """global
defaults
  mode http
  timeout client 5s
  timeout server 5s
  timeout connect 5s
frontend f
  bind 127.0.0.1:18080
  acl wanted path -m reg '^/a+b$'
  http-request deny if wanted
  default_backend b
backend b
"""


def test_haproxy_under_memory_deny_write_execute_is_explained(tmp_path):
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(CONFIG)
    assert subprocess.run(["haproxy", "-c", "-q", "-f", str(cfg)], capture_output=True, check=False).returncode == 0
    assert not writable_executable_denied()  # the test's own process: not restricted
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(cfg)], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    before, after, message = out.stdout.strip().split(" ", 2)
    assert (before, after) == ("False", "True")
    assert "MemoryDenyWriteExecute=no" in message and "agentd.service.d/ingress.conf" in message, message
