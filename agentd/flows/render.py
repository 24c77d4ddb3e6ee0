"""Flow records as ``agentd flows`` prints them, one line each (like ``hubble observe``).  Pure.

    TIME          NODE   SOURCE -> DESTINATION                                    PROTO  VERDICT
    10:42:26.113  node1  shop/client 10.244.1.2:40112 -> shop/web 10.244.2.3:80    TCP    DROPPED  policy ingress: shop/default-deny (default deny)
    10:42:27.001  node2  shop/client 10.244.1.2:40114 -> svc shop/web 10.96.0.10:80 => shop/web 10.244.2.3:8080  TCP  FORWARDED  new

Records come as the JSON ``GET /flows`` streams (dicts), so the CLI and tools read the same.
"""

from __future__ import annotations

import time
from typing import Any


def _where(ip: Any, port: Any) -> str:
    """``ip:port``, an IPv6 address in brackets (``[fd00:10:96::a]:80``): never ambiguous.
    Each made printable (:func:`_clean`): a gathered record is another node's word."""
    if not ip:  # a frame that is no IP packet: no address, no port
        return "-"
    ip, port = _clean(str(ip)), _clean(str(port))
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _end(peer: dict[str, Any]) -> str:
    where = _where(peer.get("ip"), peer.get("port", 0))
    pod = peer.get("pod")
    return f"{_clean(pod)} {where}" if pod else where


def _clean(text: Any) -> str:
    s = "" if text is None else str(text)
    return s if s.isprintable() else s.encode("unicode_escape").decode("ascii")


def _size(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return str(n)


def info(r: dict[str, Any]) -> str:
    """What happened, in words: the reason of a drop, the bytes and duration of an end."""
    event = r.get("event")
    if event == "drop":
        reason = _clean(r.get("reason"))
        if reason == "policy":
            policies = ", ".join(_clean(p) for p in r.get("policies") or []) or "(no policy: the pod is gone)"
            text = f"policy {_clean(r.get('direction'))}: {policies}"
            if r.get("default_deny"):
                text += " (default deny)"
        else:
            text = _clean(r.get("reason_text") or reason)
        sender = r.get("sender")
        if isinstance(sender, dict):
            who = f"{_clean(sender['pod'])} on " if sender.get("pod") else ""
            text += f" (sent by {who}{_clean(sender.get('interface'))})"
        if r.get("suppressed"):
            text += f" (+{_clean(r['suppressed'])} like it)"
        return text
    if event == "end":
        return (f"end  sent {_size(r.get('bytes_sent'))} received {_size(r.get('bytes_received'))}"
                f"  {r['duration']:.3f}s" if isinstance(r.get("duration"), (int, float)) else
                f"end  sent {_size(r.get('bytes_sent'))} received {_size(r.get('bytes_received'))}")
    return _clean(event)


def _stamp(t: Any) -> str:
    """``HH:MM:SS.mmm`` of a UNIX time, or ``-`` (none, or none a clock shows: nan, 1e400)."""
    try:
        return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int((t % 1) * 1000):03d}"
    except (TypeError, ValueError, OverflowError, OSError):
        return "-"


def line(r: dict[str, Any]) -> str:
    """One record as a line of text."""
    stamp = _stamp(r.get("time"))
    src, dst = r.get("src") or {}, r.get("dst") or {}
    svc = r.get("service")
    target = _end(dst)
    if svc:  # a translated connection whose Service is not known (deleted since): its address alone
        name = f"{_clean(svc['name'])} " if svc.get("name") else ""
        target = f"svc {name}{_where(svc.get('ip'), svc.get('port'))} => {target}"
    verdict = _clean(str(r.get("verdict", "-"))).upper()
    return (f"{stamp}  {_clean(r.get('node'))}  {_end(src)} -> {target}  {_clean(r.get('protocol'))}  "
            f"{verdict}  {info(r)}")


def notice(r: dict[str, Any]) -> str | None:
    """A line of the stream that is no record, as ``agentd flows`` says it (on stderr): a node
    that could not be asked, or records lost -- a gathered stream names the node whose records
    they were (``"node"``); unnamed, this reader missed them (too slow for the stream).  None
    for a record."""
    if "error" in r:
        return f"node {_clean(r.get('node'))}: {_clean(r['error'])}"
    if "lost" in r:
        whose = f"node {_clean(r['node'])}: " if r.get("node") else ""
        why = r.get("why") or ("not read fast enough from it" if whose else "this reader was too slow")
        return f"{whose}{_clean(r['lost'])} records lost ({_clean(why)})"
    return None
