"""scripts/dev setup's apt step, run in bash with apt-get, dpkg and dpkg-query stubbed (no
package is installed, nothing outside tmp_path is written): the note that docker.io is this
setup's -- after which every later run disables docker.socket and docker.service -- is made
only when this setup's install left docker.io installed."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = (ROOT / "scripts" / "dev").read_text()


def functions() -> str:
    """Every shell function of scripts/dev (defining them runs nothing)."""
    return "\n".join(re.findall(r"^[a-z_]+\(\) \{.*?^\}$", SCRIPT, re.MULTILINE | re.DOTALL))


STUBS = r"""
set -euo pipefail
APT_PACKAGES=(iproute2 docker.io)
log() { :; }
dpkg() { :; }
quiet_docker() { :; }
dpkg-query() {  # -W -f='${Status}' PACKAGE
  grep -qx -- "${@: -1}" "$T/installed" || return 1
  printf 'install ok installed'
}
apt-get() {
  case " $* " in *" update "*) return 0 ;; esac
  if [ "$GETS_DOCKER" = 1 ]; then echo docker.io >> "$T/installed"; fi
  return "$APT_STATUS"
}
"""


@pytest.mark.parametrize(
    ("gets_docker", "apt_status", "noted"),
    [
        (0, 100, False),  # the install failed: a docker.io installed later is the operator's
        (1, 0, True),
        (1, 100, True),  # docker.io went in, another package failed after it
    ],
)
def test_docker_io_is_noted_as_setups_only_once_setup_installed_it(tmp_path, gets_docker, apt_status, noted):
    (tmp_path / "installed").write_text("iproute2\n")
    mark = tmp_path / "agentd-dev" / "docker.io-installed-by-setup"
    body = functions().replace("/usr/sbin/policy-rc.d", str(tmp_path / "policy-rc.d"))
    script = f"{body}\n{STUBS}\nDOCKER_MARK={mark}\nsetup_apt\n"  # the stubs, defined after, win
    proc = subprocess.run(["bash", "-c", script], check=False, capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "T": str(tmp_path), "GETS_DOCKER": str(gets_docker),
                               "APT_STATUS": str(apt_status)})
    assert (proc.returncode == 0) == (apt_status == 0), proc.stderr
    assert mark.exists() == noted
    assert not (tmp_path / "policy-rc.d").exists()  # the install's policy went again, also on failure
