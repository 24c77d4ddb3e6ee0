"""IP forwarding for the pod families, on a /proc/sys laid out in a temporary directory."""

import pytest

from agentd.kernel import sysctl


def _root(tmp_path, ip_forward="0", forwarding6="0", accept_ra=None):
    (tmp_path / "net/ipv4").mkdir(parents=True)
    (tmp_path / "net/ipv4/ip_forward").write_text(ip_forward + "\n")
    for name, value in {"all": forwarding6, **(accept_ra or {})}.items():
        (tmp_path / "net/ipv6/conf" / name).mkdir(parents=True)
        (tmp_path / "net/ipv6/conf" / name / ("forwarding" if name == "all" else "accept_ra")).write_text(value + "\n")
    return tmp_path


@pytest.mark.parametrize(("versions", "changed"), [({4: 1}, ["net.ipv4.ip_forward"]), ([6], ["net.ipv6.conf.all.forwarding"]),
                                                   ([4, 6], ["net.ipv4.ip_forward", "net.ipv6.conf.all.forwarding"])])
def test_forwarding_on_for_the_pod_families(tmp_path, versions, changed):
    root = _root(tmp_path)
    assert sysctl.enable_forwarding(versions, root) == changed
    assert (root / "net/ipv4/ip_forward").read_text().strip() == ("1" if 4 in versions else "0")
    assert (root / "net/ipv6/conf/all/forwarding").read_text().strip() == ("1" if 6 in versions else "0")
    assert sysctl.enable_forwarding(versions, root) == []  # already on: nothing written


def test_a_missing_key_is_an_os_error_naming_it(tmp_path):
    with pytest.raises(OSError, match="ip_forward"):
        sysctl.enable_forwarding([4], tmp_path)


def test_interfaces_that_would_stop_taking_router_advertisements(tmp_path):
    root = _root(tmp_path, accept_ra={"eth0": "1", "eth1": "2", "eth2": "0", "default": "1", "lo": "1"})
    assert sysctl.ra_ignored(root) == ["eth0"]
    assert sysctl.ra_ignored(tmp_path / "nowhere") == []
