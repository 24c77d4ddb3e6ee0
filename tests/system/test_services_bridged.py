"""A Service whose chosen endpoint is a pod on the client's own node, with flow records off
and br_netfilter not handing bridged frames to the IP hooks (bridge-nf-call-iptables = 0, as on
a host without the module): the endpoint's reply goes to the client over the bridge, at layer 2,
and must still be translated back (source the VIP, not the endpoint) -- so while Services
translate, every local pod's traffic goes up through the node's IP stack, as it does with flow
records on.  (kube-proxy on a bridge needs br_netfilter for this; agentd does not.)  Isolated
by a policy allowing nothing, the endpoint still reaches itself through its Service (routed
here: the inet chains' hairpin acceptance; test_services.py has the bridged one)."""

from __future__ import annotations

import time

import pytest
from netpol_lab import converged as policy_converged

from agentd.lab.lab import Lab, LabSpec
from agentd.lab.netns import unique_tag
from agentd.lab.svcecho import Echo
from agentd.lab.wait import auntil

pytestmark = pytest.mark.asyncio(loop_scope="function")


async def test_a_same_node_endpoint_answers_through_its_service_without_br_netfilter(tmp_path):
    spec = LabSpec(name="sb" + unique_tag("")[:6], nodes=1, pods=0,
                   extra={"node1": {"flows": {"enabled": False}}})
    lab = Lab(spec, root=tmp_path / "labs")
    echo: list[Echo] = []
    res = None
    try:
        await lab.up(timeout=90)
        node = lab.nodes[0]
        await lab.ready.agents_ready(60)  # one node: no peer or route for lab.up to wait for
        # Off where br_netfilter is loaded (its sysctls are the namespace's); without it, off already.
        keys = node.ns.exec("ls", "/proc/sys/net/bridge", check=False).split()
        for key in ("bridge-nf-call-iptables", "bridge-nf-call-ip6tables"):
            if key in keys:
                node.ns.sysctl(f"net.bridge.{key}", 0)
        web = await lab.add_pod(node, "svc", "web", labels={"app": "web"},
                                ports=[{"name": "http", "containerPort": 8080, "protocol": "TCP"}])
        client = await lab.add_pod(node, "svc", "client", labels={"app": "client"})
        echo.append(w := await Echo.start(web, "web", [("tcp", 8080)]))
        echo.append(c := await Echo.start(client, "client"))
        res = await lab.resources()
        rev = await res.apply([{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "svc"},
                                "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": "http"}]}}])

        def applied() -> bool:
            v = node.api_or_none("/services?view=summary") or {}
            return v.get("revision", 0) >= rev and not v.get("error")

        await auntil(applied, 20, in_thread=True, what="the Service applied on node1")
        vip = (await res.get("Service", "svc", "web"))["spec"]["clusterIP"]
        assert (await c.tcp(web.ip, 8080, count=3)) == {"names": {"web": 3}, "failed": 0}  # the pod itself: bridged
        start = time.monotonic()
        got = await c.tcp(vip, 80, count=10)
        assert got == {"names": {"web": 10}, "failed": 0}, (got, time.monotonic() - start)
        # Isolated by a policy allowing nothing, web still reaches itself through its Service
        # (here routed, not bridged: the inet chains' hairpin acceptance), the client does not.
        rev = await res.apply([{"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                                "metadata": {"name": "nothing", "namespace": "svc"},
                                "spec": {"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Ingress", "Egress"]}}])
        await policy_converged(lab, rev)
        assert (await w.tcp(vip, 80, count=3, timeout=2.0)) == {"names": {"web": 3}, "failed": 0}
        assert (await c.tcp(vip, 80, count=1, timeout=1.0)) == {"names": {}, "failed": 1}
    finally:
        for e in echo:
            await e.close()
        if res is not None:
            await res.close()
        await lab.down()
