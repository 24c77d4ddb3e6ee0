"""Resources in a lab's etcd from the test process: apply, get, delete, label.

The lab's etcd listens inside the lab's namespaces, so the test process (in the root
namespace) cannot reach it.  :class:`LabResources` runs one small helper process inside a
node's namespace (``python -m agentd.lab.resources``) that holds a
:class:`~agentd.resources.store.ResourceStore` and answers JSON lines on its stdin, so a
test applies a policy in milliseconds and learns the etcd revision of the write (what the
agents report having applied in ``GET /policy``).  Manifests go through the same
validation as ``agentd apply``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import yaml


class LabResourcesError(RuntimeError):
    pass


class LabResources:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self._lock = asyncio.Lock()

    @classmethod
    async def start(cls, node: Any) -> LabResources:
        cfg = node.config()
        endpoints = ",".join(cfg["etcd"]["endpoints"])
        proc = await asyncio.create_subprocess_exec(
            "ip", "netns", "exec", node.ns.name, sys.executable, "-m", "agentd.lab.resources", endpoints,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        self = cls(proc)
        await self.call({"op": "ping"})
        return self

    async def call(self, request: dict[str, Any], timeout: float = 30.0) -> Any:
        async with self._lock:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            await self.proc.stdin.drain()
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not line:
            err = b""
            if self.proc.stderr is not None:
                err = await self.proc.stderr.read()
            raise LabResourcesError(f"the resource helper exited: {err.decode(errors='replace').strip()[-500:]}")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise LabResourcesError(reply.get("error", "failed"))
        return reply.get("result")

    async def apply(self, manifests: str | dict[str, Any] | list[dict[str, Any]]) -> int:
        """Apply objects (YAML/JSON text, one dict or a list); returns the etcd revision of the write."""
        if isinstance(manifests, str):
            objs = [d for d in yaml.safe_load_all(manifests) if d is not None]
        elif isinstance(manifests, dict):
            objs = [manifests]
        else:
            objs = list(manifests)
        return await self.call({"op": "apply", "objects": objs}, timeout=120)

    async def put_records(self, objs: list[dict[str, Any]]) -> None:
        """Write records only agents write (pods of nodes that do not run here), without a lease."""
        await self.call({"op": "put_records", "objects": objs}, timeout=120)

    async def delete(self, kind: str, namespace: str, name: str) -> int:
        return await self.call({"op": "delete", "kind": kind, "namespace": namespace, "name": name})

    async def label(self, kind: str, namespace: str, name: str, changes: dict[str, str | None]) -> int:
        return await self.call(
            {"op": "label", "kind": kind, "namespace": namespace, "name": name, "changes": changes}
        )

    async def list(self, kind: str) -> list[dict[str, Any]]:
        return await self.call({"op": "list", "kind": kind})

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return await self.call({"op": "get", "kind": kind, "namespace": namespace, "name": name})

    async def subnets(self) -> dict[str, str]:
        """Every subnet lease in etcd: subnet -> node (``/agentd/subnets/<ip>-<len>``)."""
        return await self.call({"op": "subnets"})

    async def close(self) -> None:
        if self.proc.returncode is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 5)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


# ------------------------------------------------------------------ the helper process


async def _serve(endpoints: list[str]) -> None:
    from agentd.datastore.store import Datastore
    from agentd.resources import kinds, manifests
    from agentd.resources.store import ResourceStore

    ds = Datastore(endpoints)
    store = ResourceStore(ds, timeout=20)
    await ds.connect(timeout=20)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    async def handle(req: dict[str, Any]) -> Any:
        op = req["op"]
        if op == "ping":
            return None
        if op == "apply":
            docs = [manifests.Document(f"object {i}", o) for i, o in enumerate(req["objects"], start=1)]
            objs = manifests.validate_all(docs, "lab")
            applied = await store.apply(objs)
            return max(a.revision for a in applied)
        if op == "subnets":  # the subnet leases, as the agents took them
            return {str(subnet): lease.node for subnet, lease in (await ds.list_subnets()).items()}
        if op == "put_records":  # agent-owned records (pods of simulated nodes, for benches)
            for o in req["objects"]:
                await store.put_owned(kinds.validate(o), lease=None, expect=0)
            return None
        if op == "ingress_nodes":
            return await store.ingress_nodes()
        kind = kinds.lookup(req["kind"])
        if op == "delete":
            return await store.delete(kind, req["namespace"], req["name"])
        if op == "label":
            obj, _ = await store.label(kind, req["namespace"], req["name"], req["changes"], overwrite=True)
            return int(obj["metadata"].get("resourceVersion", 0) or 0)
        if op == "list":
            return await store.list(kind)
        if op == "get":
            return await store.get(kind, req["namespace"], req["name"])
        raise ValueError(f"unknown op {op!r}")

    try:
        while line := await reader.readline():
            try:
                result = await handle(json.loads(line))
                reply = {"ok": True, "result": result}
            except Exception as err:  # noqa: BLE001 - reported to the test, one line
                reply = {"ok": False, "error": f"{type(err).__name__}: {err}"}
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()
    finally:
        await ds.close()


if __name__ == "__main__":
    asyncio.run(_serve(sys.argv[1].split(",")))
