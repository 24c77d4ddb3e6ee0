# agentd in a container: the agent, agentd-cni, the reference CNI plugins and the tools an
# operator reaches for (ip, ping). Used by compose.yaml.
#
#   docker build -t agentd .
#   docker run --rm agentd agentd --version
#
# BASE is the image to start from: the slim Python image by default (from a registry).
# Without a registry, `scripts/dev compose up` builds a base from Debian packages instead
# (mmdebstrap + docker import, every package below already in it) and passes
#   --build-arg BASE=agentd-base:local --build-arg PIP_OFFLINE=1
# with the Python dependencies as wheels in docker/wheels/ (pip download on the host).
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}

# iproute2: ip route/link/neigh, bridge fdb (troubleshooting; the agent itself uses netlink)
# libbpf1: libbpf.so.1, which loads the BPF programs (iproute2 depends on it too)
# containernetworking-plugins: bridge + host-local in /usr/lib/cni, which agentd-cni delegates to
# iputils-ping: the compose lab's pod-to-pod check; util-linux has nsenter; libnftables1:
# NetworkPolicy and Services (the agent calls libnftables)
# Only what the base lacks is installed: a base made from Debian packages has all of it, and
# no package index to fetch from.
RUN need=""; for p in iproute2 libbpf1 containernetworking-plugins iputils-ping util-linux procps libnftables1; do \
      dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || need="$need $p"; done; \
    if [ -n "$need" ]; then \
      apt-get update && apt-get install -y --no-install-recommends $need && rm -rf /var/lib/apt/lists/*; fi

# The package, in a virtualenv at /opt/agentd (Debian's own Python refuses `pip install`
# outside one, PEP 668) linked to /usr/local/bin/agentd and /usr/local/bin/agentd-cni (the
# path systemd/agentd.service uses too). `pip install .` builds the data plane's compiled
# parts: the C fast path (gcc) and the BPF programs (clang for the BPF target, the libbpf
# headers); the compilers are installed for the build only when the base lacks them, and
# removed again; the checks fail the build if either part did not build or libbpf cannot
# read both BPF objects as layout.py and podpath.py expect them. Sources only; tests and
# docs stay out. PIP_OFFLINE=1: no package index, every dependency from docker/wheels/
# (which is otherwise empty and unused).
ARG PIP_OFFLINE=
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY proto ./proto
COPY bgp ./bgp
COPY agentd ./agentd
COPY docker/wheels /tmp/wheels
RUN need=""; for p in gcc libc6-dev clang-16 libbpf-dev; do \
      dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || need="$need $p"; done; \
    if [ -n "$need" ]; then \
      apt-get update && apt-get install -y --no-install-recommends $need; fi \
 && python3 -m venv /opt/agentd \
 && /opt/agentd/bin/pip install --no-cache-dir ${PIP_OFFLINE:+--no-index} --find-links /tmp/wheels . \
 && ln -s /opt/agentd/bin/agentd /opt/agentd/bin/agentd-cni /usr/local/bin/ \
 && if [ -n "$need" ]; then \
      apt-get purge -y $need && apt-get autoremove -y && rm -rf /var/lib/apt/lists/*; fi \
 && cd / && rm -rf /src /tmp/wheels \
 && agentd --version \
 && /opt/agentd/bin/python -c "from agentd.dataplane import _fast; lib, why = _fast.load(); assert lib, why" \
 && /opt/agentd/bin/python -c "from agentd.dataplane.bpf import OBJECT, layout, libbpf, podpath; o = libbpf.BpfObject(OBJECT); layout.check(o.maps, o.programs); podpath.check(libbpf.BpfObject(podpath.OBJECT))"

# The documented example configuration: every key with its default. The compose nodes
# override what differs per node through AGENTD_<SECTION>_<KEY> variables.
COPY etc/agentd.toml /etc/agentd/agentd.toml
COPY docker/agentd-node /usr/local/bin/agentd-node
RUN chmod 0755 /usr/local/bin/agentd-node \
 && agentd check-config --config /etc/agentd/agentd.toml --set node.address=192.0.2.1 --set node.name=build

WORKDIR /
# grpc's fork handlers can crash the data-plane worker's child before its exec (see
# systemd/agentd.service, which sets the same).
ENV GRPC_ENABLE_FORK_SUPPORT=0
# BGP, VXLAN, the udp backend; the REST API listens on loopback only (9099/tcp). The BPF data
# path needs CAP_BPF and a bpffs at /sys/fs/bpf (compose.yaml's nodes get both; elsewhere
# udp and ipip fall back to the user-space worker and say why).
EXPOSE 179/tcp 4789/udp 8285/udp
STOPSIGNAL SIGTERM
CMD ["agentd", "run", "--config", "/etc/agentd/agentd.toml"]
