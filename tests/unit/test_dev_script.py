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


def _setup_apt(tmp_path: Path, stubs: str) -> subprocess.CompletedProcess:
    body = functions().replace("/usr/sbin/policy-rc.d", str(tmp_path / "policy-rc.d"))
    script = f"{body}\n{STUBS}\n{stubs}\nDOCKER_MARK={tmp_path / 'mark'}\nsetup_apt\n"
    return subprocess.run(["bash", "-c", script], check=False, capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "T": str(tmp_path), "GETS_DOCKER": "0", "APT_STATUS": "0"})


def test_packages_an_interrupted_run_left_unconfigured_are_configured_with_no_daemon_started(tmp_path):
    """dpkg --configure -a (what a run cut off during apt-get install left unpacked) runs the
    packages' scripts: they start dockerd (docker0 in the root namespace), etcd, bird... unless
    the policy that forbids it is in place first -- it was written only after."""
    (tmp_path / "installed").write_text("iproute2\n")
    proc = _setup_apt(tmp_path, r"""
dpkg() {  # --configure -a
  if [ -e "$T/policy-rc.d" ]; then echo "configure: policy in place" >> "$T/seen"; else echo "configure: NO policy" >> "$T/seen"; fi
}
""")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "seen").read_text() == "configure: policy in place\n"
    assert not (tmp_path / "policy-rc.d").exists()


@pytest.mark.parametrize("leftover", [True, False])
def test_a_policy_a_killed_run_left_goes_and_the_machines_own_is_put_back(tmp_path, leftover):
    """A run killed during apt (CI's time limit) leaves its "exit 101" policy: the next run took
    it for the machine's own and put it back every time -- no package upgrade could start a
    service again.  Ours is marked and goes; an operator's is kept."""
    (tmp_path / "installed").write_text("iproute2\n")
    policy = tmp_path / "policy-rc.d"
    if leftover:
        policy.write_text("#!/bin/sh\n# agentd-dev: no daemon starts during setup's apt\nexit 101\n")
    else:
        policy.write_text("#!/bin/sh\n# the operator's\nexit 0\n")
    proc = _setup_apt(tmp_path, "")
    assert proc.returncode == 0, proc.stderr
    if leftover:
        assert not policy.exists()
    else:
        assert policy.read_text() == "#!/bin/sh\n# the operator's\nexit 0\n"
    assert not list(tmp_path.glob("policy-rc.d.agentd-dev.*"))


def test_a_venv_of_another_python_is_made_again(tmp_path):
    """setup_python kept a .venv made by another Python (an older one: pip then backtracked for
    ever on requires-python >= 3.11, its output hidden in a log)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    old = venv / "bin" / "python"
    old.write_text('#!/bin/sh\ncase "$*" in *version_info*) echo 3.10 ;; *) exit 0 ;; esac\n')
    old.chmod(0o755)
    script = f"""{functions()}
set -euo pipefail
log() {{ echo "$*"; }}
build_fastpath() {{ :; }}
py3() {{ case "$*" in *version_info*) echo 3.11 ;; *"-m venv"*) echo "venv made: $*" ;; esac; }}
PYTHON=py3 VENV={venv} ROOT={ROOT}
setup_python || true
"""
    proc = subprocess.run(["bash", "-c", script], check=False, capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin"})
    assert "venv made: -m venv --clear " + str(venv) in proc.stdout, proc.stdout + proc.stderr
