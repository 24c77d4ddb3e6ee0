# The agent's image with systemd as PID 1 and systemd/agentd.service installed as shipped:
# how tests/system/test_systemd_container.py runs the unit under a real systemd.
#
#   docker build -f docker/systemd.Dockerfile --build-arg AGENTD_IMAGE=agentd:latest -t agentd-systemd .
#   docker run -d --cap-add SYS_ADMIN --cap-add NET_ADMIN --cap-add BPF --cap-add PERFMON \
#       --tmpfs /run --tmpfs /run/lock -v /sys/fs/cgroup:/sys/fs/cgroup:ro agentd-systemd
# (Docker 20.10 knows neither BPF nor PERFMON: `--runtime runc-bpf-caps`, docker/runc-bpf-caps.)
ARG AGENTD_IMAGE=agentd:latest
FROM ${AGENTD_IMAGE}

# systemd (and its /sbin/init), and HAProxy for the Ingress proxy (its package makes the
# haproxy user, [ingress] user's default), unless the base has them already (the one made
# from Debian packages does, and has no package index to fetch from).
RUN need=""; for p in systemd systemd-sysv haproxy; do \
      dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || need="$need $p"; done; \
    if [ -n "$need" ]; then \
      apt-get update && apt-get install -y --no-install-recommends $need && rm -rf /var/lib/apt/lists/*; fi \
 # Units that have nothing to do in a container (no consoles, no kernel modules, no udev).
 && systemctl mask getty.target console-getty.service systemd-modules-load.service \
      systemd-udevd.service systemd-udev-trigger.service systemd-remount-fs.service \
      sys-kernel-debug.mount sys-kernel-tracing.mount systemd-firstboot.service \
 # The package's own HAProxy service: the agent runs the node's Ingress proxy itself.
 && systemctl mask haproxy.service \
 && systemctl set-default multi-user.target

# The unit exactly as shipped: ExecStart=/usr/local/bin/agentd is where the agent image links it.
COPY systemd/agentd.service /etc/systemd/system/agentd.service

ENV container=docker
# systemd's own shutdown signal
STOPSIGNAL SIGRTMIN+3
CMD ["/sbin/init"]
