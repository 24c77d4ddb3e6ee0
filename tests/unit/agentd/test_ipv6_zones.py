"""An IPv6 zone (``fd00::5%eth0``) is refused wherever agentd reads an address or a network
that other hosts route to: Python's ipaddress takes one, but the Kubernetes API server
(net.ParseIP), host-local (net.ParseCIDR) and nftables do not, and ``fd00::5%eth0`` would be a
second spelling of ``fd00::5`` (a second etcd key for one cluster IP). Pure."""

from __future__ import annotations

import pytest

from agentd.cni import netconf
from agentd.config.settings import ConfigError, load_config
from agentd.datastore import records
from agentd.resources import pod, service
from agentd.resources.validation import Invalid

from .test_config_families import Host


@pytest.mark.parametrize("key, value", [
    ("AGENTD_NETWORK_CIDR_V6", "fd00:10:244::%eth0/48"),
    ("AGENTD_NETWORK_SERVICE_CIDR_V6", "fd00:10:96::%eth0/112"),
])  # fmt: skip
def test_config_refuses_a_zoned_network(key, value):
    with pytest.raises(ConfigError, match=key.removeprefix("AGENTD_").lower().replace("network_", "")):
        load_config(env={"AGENTD_NETWORK_IP_FAMILY": "dual", key: value}, host=Host())


@pytest.mark.parametrize("spec, path", [
    ({"clusterIP": "fd00:10:96::5%eth0"}, "spec.clusterIP"),
    ({"clusterIPs": ["fd00:10:96::5%eth0"]}, "spec.clusterIPs[0]"),
    ({"externalIPs": ["2001:db8::1%1"]}, "spec.externalIPs[0]"),
])  # fmt: skip
def test_a_service_with_a_zoned_address_is_invalid(spec, path):
    with pytest.raises(Invalid, match="must be .*valid IP address") as err:
        service.validate_spec({"selector": {"app": "web"}, "ports": [{"port": 80}], **spec})
    assert path in str(err.value)


def test_an_endpoint_slice_with_a_zoned_address_is_invalid():
    slice_ = {"addressType": "IPv6", "endpoints": [{"addresses": ["fd00:10:244:1::5%eth0"]}], "ports": [{"port": 80}]}
    with pytest.raises(Invalid, match="endpoints\\[0\\].addresses\\[0\\]"):
        service.validate_slice(slice_)
    slice_["endpoints"][0]["addresses"] = ["fd00:10:244:1::5"]
    assert service.validate_slice(slice_)["endpoints"][0]["addresses"] == ["fd00:10:244:1::5"]


def test_a_pod_status_with_a_zoned_address_is_invalid():
    with pytest.raises(Invalid, match="must be a valid IP address"):
        pod.validate_status({"podIP": "fd00:10:244:1::5%eth0"})


def test_etcd_records_refuse_zoned_addresses_and_networks():
    with pytest.raises(records.RecordError, match="is not an IPv6 address"):
        records._address("node", "address_v6", "2001:db8::10%eth0", 6)
    with pytest.raises(records.RecordError, match="zone"):
        records._network("cluster", "cidr_v6", "fd00:10:244::%eth0/48", 6)
    assert str(records._address("node", "address_v6", "2001:db8::10", 6)) == "2001:db8::10"


@pytest.mark.parametrize("line, word", [
    ("AGENTD_IPV6_NETWORK=fd00:10:244::%eth0/48\nAGENTD_IPV6_SUBNET=fd00:10:244:3::1/64\n", "AGENTD_IPV6_NETWORK"),
    ("AGENTD_IPV6_NETWORK=fd00:10:244::/48\nAGENTD_IPV6_SUBNET=fd00:10:244:3::1%eth0/64\n", "AGENTD_IPV6_NETWORK"),
    ("AGENTD_DNS=169.254.20.10\nAGENTD_DNS_V6=fd00::53%eth0\n", "AGENTD_DNS_V6"),
])  # fmt: skip
def test_the_subnet_file_refuses_zones(line, word):
    text = "AGENTD_NETWORK=10.244.0.0/16\nAGENTD_SUBNET=10.244.3.1/24\nAGENTD_MTU=1450\n" + line
    with pytest.raises(netconf.SubnetFileError, match=word):
        netconf.parse_subnet_file(text, "f")
