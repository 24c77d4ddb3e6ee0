"""The ingress controller's sync (agentd/ingress/controller.py) with a fake proxy: settings
HAProxy refuses stay refused (and in /status) on later syncs; a failed reload is not reported
as applied and is tried again, with a backoff."""

from __future__ import annotations

import asyncio
from pathlib import Path

from agentd.config.settings import load_config
from agentd.datastore.store import Datastore
from agentd.ingress.controller import IngressController
from agentd.ingress.proxy import ConfigRefused, ProxyError
from agentd.resources.ingress_settings import Settings

CONFIGMAP = ("kube-system", "agentd-ingress")


class FakeProxy:
    """Its check refuses a configuration that holds ``bogus``, as HAProxy an unknown fetch."""

    running, pid, adopted, started_at = True, 1, False, None

    def __init__(self) -> None:
        self.refuse = ["bogus"]  # a configuration holding any of these is refused
        self.checks: list[str] = []
        self.reloads = 0
        self.fail_reloads = 0  # so many reloads fail (the master socket timing out)

    async def check(self, path: Path) -> None:
        text = Path(path).read_text()
        self.checks.append(text)
        for word in self.refuse:
            if word in text:
                raise ConfigRefused(f"[ALERT] unknown fetch method '{word}'")

    async def reload(self) -> None:
        if self.fail_reloads:
            self.fail_reloads -= 1
            raise ProxyError("timeout on the master socket")
        self.reloads += 1

    async def stats(self) -> list:
        return []

    async def info(self) -> dict:
        return {}

    async def command(self, command: str) -> str:
        return "New server registered" if command.startswith("add server") else ""


def controller(tmp_path: Path, **ingress: str) -> tuple[IngressController, FakeProxy]:
    cfg = load_config(None, env={}, overrides={"node.address": "10.1.1.1", "node.name": "n1",
                                               **{f"ingress.{k}": v for k, v in ingress.items()}})
    ctl = IngressController("n1", Datastore(["http://127.0.0.1:2379"], "/agentd"), cfg.ingress, ["10.1.1.1"], tmp_path)
    ctl.paths.certs.mkdir(parents=True)
    proxy = ctl.proxy = FakeProxy()  # type: ignore[assignment]
    return ctl, proxy


def test_refused_settings_stay_refused_and_in_status_on_later_syncs(tmp_path):
    ctl, proxy = controller(tmp_path)
    ctl.objects["ConfigMap"][CONFIGMAP] = {"data": {"proxy-body-size": "100m",
                                                    "frontend-snippet": "http-request set-header X-A %[bogus]"}}  # fmt: skip

    async def main():
        await ctl._sync()
        error = ctl.settings_error
        assert error is not None and "bogus" in error
        assert ctl.settings == Settings() and proxy.reloads == 1
        await ctl._sync()  # an endpoint change: the same ConfigMap, parsed without complaint
        assert ctl.settings_error == error and ctl.settings == Settings()
        assert proxy.reloads == 1  # what runs is what was loaded: no reload
        ctl.objects["ConfigMap"][CONFIGMAP] = {"data": {"proxy-body-size": "100m"}}  # fixed
        await ctl._sync()
        assert ctl.settings_error is None and ctl.settings.body_size == 100 << 20
        assert proxy.reloads == 2 and "bogus" not in proxy.checks[-1]

    asyncio.run(main())


def test_refused_settings_fall_back_to_the_last_settings_accepted(tmp_path):
    ctl, proxy = controller(tmp_path)
    good = {"proxy-body-size": "100m", "frontend-snippet": "http-request set-header X-A good"}
    ctl.objects["ConfigMap"][CONFIGMAP] = {"data": good}

    async def main():
        await ctl._sync()
        assert ctl.settings_error is None and ctl.settings.body_size == 100 << 20
        accepted = ctl.settings
        ctl.objects["ConfigMap"][CONFIGMAP] = {"data": {**good, "frontend-snippet": "http-request set-header X-A %[bogus]"}}
        await ctl._sync()
        assert ctl.settings_error is not None and "bogus" in ctl.settings_error
        assert ctl.settings == accepted and "X-A good" in proxy.checks[-1]  # not the defaults
        await ctl._sync()  # a later sync: still the last accepted, the error kept
        assert ctl.settings == accepted and "bogus" in ctl.settings_error
        proxy.refuse.append("X-A good")  # what was accepted is refused now as well: the defaults
        ctl._structure = None  # as after an Ingress change: checked and loaded again
        await ctl._sync()
        assert ctl.settings == Settings() and "bogus" in ctl.settings_error
        assert "X-A" not in proxy.checks[-1]

    asyncio.run(main())


CLASS = {"metadata": {"name": "agentd", "annotations": {"ingressclass.kubernetes.io/is-default-class": "true"}},
         "spec": {"controller": "agentd.io/ingress-controller"}}  # fmt: skip


def shop_ingress(name: str) -> dict:
    return {"metadata": {"namespace": "shop", "name": name, "creationTimestamp": "2024-01-01T00:00:00Z"},
            "spec": {"rules": [{"host": f"{name}.example", "http": {"paths": [
                {"path": "/", "pathType": "Prefix", "backend": {"service": {"name": "web", "port": {"number": 80}}}}]}}]}}  # fmt: skip


def test_a_check_that_fails_by_itself_or_for_an_ingress_costs_no_settings(tmp_path):
    """Settings HAProxy accepted are not blamed for a check that failed by itself (killed, say:
    no ALERT, twice in a row) nor for an Ingress it refuses (with the defaults too): not
    applied, tried again later, the ConfigMap's settings kept for when the Ingress is gone."""
    ctl, proxy = controller(tmp_path)
    ctl.objects["IngressClass"][("", "agentd")] = CLASS
    ctl.objects["ConfigMap"][CONFIGMAP] = {"data": {"ssl-redirect": "false", "proxy-body-size": "0"}}
    ctl.objects["Ingress"][("shop", "shop")] = shop_ingress("shop")
    check, killed = proxy.check, [0]

    async def sometimes_killed(path):
        if killed[0]:
            killed[0] -= 1
            raise ProxyError("haproxy -c exited with -9")
        await check(path)

    proxy.check = sometimes_killed  # type: ignore[method-assign]

    async def main():
        await ctl._sync()
        assert ctl.settings.ssl_redirect is False and ctl.settings.body_size == 0 and proxy.reloads == 1
        killed[0] = 2
        ctl.objects["Ingress"][("shop", "two")] = shop_ingress("two")  # a reload
        await ctl._sync()  # the check killed: not applied, nobody's settings blamed
        assert proxy.reloads == 1 and ctl.settings_error is None and ctl._refused_settings is None
        assert ctl.settings.ssl_redirect is False and ctl.settings.body_size == 0
        await ctl._sync()  # killed again
        assert proxy.reloads == 1 and ctl.settings_error is None and ctl._refused_settings is None
        await ctl._sync()  # tried again: applied, with the ConfigMap's settings
        assert proxy.reloads == 2 and ctl.settings_error is None
        assert ctl.settings.ssl_redirect is False and ctl.settings.body_size == 0
        ctl.objects["Ingress"][("shop", "bogus")] = shop_ingress("bogus")  # an Ingress HAProxy refuses
        await ctl._sync()
        assert proxy.reloads == 2 and ctl.settings_error is None  # not applied, nobody's settings blamed
        # What /ingress shows is what was tried (the ConfigMap's settings), not a fallback's render.
        assert ctl.settings.ssl_redirect is False and "bogus" in proxy.checks[-1] and "ssl-redirect" not in ctl.error
        del ctl.objects["Ingress"][("shop", "bogus")]  # what runs is what is wanted again: no reload
        await ctl._sync()
        assert proxy.reloads == 2 and ctl.settings_error is None
        assert ctl.settings.ssl_redirect is False and ctl.settings.body_size == 0
        ctl.objects["Ingress"][("shop", "three")] = shop_ingress("three")
        await ctl._sync()
        assert proxy.reloads == 3 and ctl.settings_error is None
        assert ctl.settings.ssl_redirect is False and ctl.settings.body_size == 0 and "bogus" not in proxy.checks[-1]

    asyncio.run(main())


def test_the_last_settings_accepted_outlive_an_agent_restart(tmp_path):
    """HAProxy outlives the agent: a new agent adopting it with refused settings in the
    ConfigMap falls back to what that proxy accepted (loaded.json), not to the defaults."""
    import json

    ctl, proxy = controller(tmp_path)
    good = {"proxy-body-size": "100m", "ssl-redirect": "false", "frontend-snippet": "http-request set-header X-A good"}
    bad = {**good, "frontend-snippet": "http-request set-header X-A %[bogus]"}
    ctl.objects["ConfigMap"][CONFIGMAP] = {"data": good}

    async def main():
        await ctl._sync()
        accepted = ctl.settings
        ctl.objects["ConfigMap"][CONFIGMAP] = {"data": bad}
        await ctl._sync()
        assert ctl.settings == accepted and "bogus" in ctl.settings_error
        # systemctl restart agentd: a new controller adopts the same proxy (its master pid)
        new, _ = controller(tmp_path / "again")
        new.paths, new.proxy = ctl.paths, proxy  # type: ignore[assignment]
        new.objects["ConfigMap"][CONFIGMAP] = {"data": bad}
        await new._take_over()
        await new._sync()
        assert new.settings == accepted and "bogus" in new.settings_error
        assert "X-A good" in proxy.checks[-1] and "bogus" not in proxy.checks[-1]
        # a loaded.json an older agent wrote (no settings) or one with a bad field: the defaults
        for saved in (None, {"body_size": "big"}):
            loaded = json.loads(ctl.paths.loaded.read_text())
            loaded.pop("settings")
            if saved is not None:
                loaded["settings"] = saved
            ctl.paths.loaded.write_text(json.dumps(loaded))
            older, _ = controller(tmp_path / f"older{saved is None}")
            older.paths, older.proxy = ctl.paths, proxy  # type: ignore[assignment]
            older.objects["ConfigMap"][CONFIGMAP] = {"data": bad}
            await older._take_over()
            await older._sync()
            assert older.settings == Settings() and "bogus" in older.settings_error

    asyncio.run(main())


def test_a_failed_reload_is_not_applied_and_is_tried_again_with_a_backoff(tmp_path):
    ctl, proxy = controller(tmp_path)
    ctl.revision = 7
    proxy.fail_reloads = 2

    async def main():
        await ctl._sync()
        assert ctl.applied_revision == 0 and ctl.error is not None and proxy.reloads == 0
        first = ctl._retry_at
        assert first is not None and not ctl._retry_due(first - 0.01) and ctl._retry_due(first)
        await ctl._sync()  # the retry, when due: fails again, the next one waits longer
        assert ctl.applied_revision == 0 and ctl._retry_delay == 4.0
        await ctl._sync()
        assert ctl.applied_revision == 7 and proxy.reloads == 1 and ctl.error is None
        assert ctl._retry_at is None and not ctl._retry_due(float("inf"))

    asyncio.run(main())


def test_haproxy_check_runs_without_the_agents_environment(tmp_path, monkeypatch):
    """HAProxy -c expands ${VAR} and prints the value in an ALERT, which becomes settings_error:
    the check must see HAProxy's own environment, never the agent's (its BGP password)."""
    from agentd.ingress.proxy import Proxy

    fake = tmp_path / "haproxy"
    fake.write_text('#!/bin/sh\necho "[ALERT] parsing: unknown fetch \'${AGENTD_BGP_PASSWORD:-unset}\'"\nexit 1\n')
    fake.chmod(0o755)
    monkeypatch.setenv("AGENTD_BGP_PASSWORD", "s3cret")
    proxy = Proxy(None, binary=str(fake))  # type: ignore[arg-type]
    try:
        asyncio.run(proxy.check(tmp_path / "haproxy.cfg"))
    except ProxyError as e:
        assert "s3cret" not in str(e) and "unset" in str(e)
    else:
        raise AssertionError("the check did not fail")


def test_after_an_etcd_restore_the_applied_revision_follows_etcd_back(tmp_path):
    """etcd restored from a backup (revision 1000 -> 900), then a change at 901: the revision
    applied says 901 once that is served, not 1000 (a waiter for >= 901 passed before)."""
    from agentd.resources.store import ResourceEvent

    ctl, _ = controller(tmp_path)

    async def main():
        ctl._on_resource(ResourceEvent("snapshot", 1000))
        await ctl._sync()
        assert ctl.applied_revision == 1000
        ctl._on_resource(ResourceEvent("snapshot", 900))
        assert ctl.revision == 900 and ctl.applied_revision <= 900
        ctl._on_resource(ResourceEvent("put", 901, key=("Namespace", "", "x"), obj={}))
        assert ctl.revision == 901 and ctl.applied_revision <= 900
        await ctl._sync()
        assert ctl.applied_revision == 901

    asyncio.run(main())


def test_a_node_key_etcd_would_not_delete_is_deleted_at_the_next_try(tmp_path):
    """A failed start takes the node's key away; etcd away then, the key is still ours to take
    away (published), so the next failed start tries again."""
    ctl, _proxy = controller(tmp_path)
    ctl._published = (7, "{}")
    deleted: list[bytes] = []

    async def away(what, call, timeout):
        raise ConnectionError("etcd unreachable")

    async def there(what, call, timeout):
        class Client:
            async def delete(self, key):
                deleted.append(key)

        return await call(Client())

    async def main():
        ctl.ds.request = away  # type: ignore[method-assign]
        await ctl._unpublish()
        assert ctl._published == (7, "{}") and not deleted
        ctl.ds.request = there  # type: ignore[method-assign]
        await ctl._unpublish()
        assert ctl._published is None and deleted == [b"/agentd/ingress/nodes/n1"]

    asyncio.run(main())


def test_after_a_failed_reload_ingress_and_metrics_show_what_is_served_not_what_was_tried(tmp_path):
    """A new Ingress whose reload fails is not served: /ingress, /status and the metrics go on
    showing the table the proxy loaded (the error set), and the new one once a reload takes it."""
    ctl, proxy = controller(tmp_path)
    ctl.objects["IngressClass"][("", "agentd")] = CLASS
    ctl.objects["Ingress"][("shop", "old")] = shop_ingress("old")

    def hosts() -> list[str]:
        return [v["host"] for v in ctl.views.view()["hosts"]]

    def series() -> set[str]:
        return {s.labels["ingress"] for m in ctl.views.collect() for s in m.samples if "ingress" in s.labels}

    async def main():
        await ctl._sync()
        assert hosts() == ["old.example"] and proxy.reloads == 1
        ctl.objects["Ingress"][("shop", "new")] = shop_ingress("new")
        proxy.fail_reloads = 1
        await ctl._sync()
        assert ctl.error is not None and "reload failed" in ctl.error
        assert hosts() == ["old.example"], "the tried table is shown as served"
        assert ctl.views.status()["ingresses"] == 1 and series() == {"old"}
        await ctl._sync()  # tried again: loaded
        assert ctl.error is None and proxy.reloads == 2
        assert hosts() == ["new.example", "old.example"] and series() == {"new", "old"}

    asyncio.run(main())


def test_after_an_adoption_a_failed_reload_says_its_table_is_the_one_wanted(tmp_path):
    """An agent that adopted the proxy does not know the table it runs until a sync finds or
    loads it: a first reload that fails shows the table wanted, and says so."""
    ctl, proxy = controller(tmp_path)
    ctl.objects["IngressClass"][("", "agentd")] = CLASS
    ctl.objects["Ingress"][("shop", "old")] = shop_ingress("old")

    async def main():
        await ctl._sync()
        assert ctl.views.status()["table"] == "served"
        await ctl._take_over()  # the agent restarted: the proxy (pid 1) adopted
        assert ctl.views.status()["table"] == "wanted"
        await ctl._sync()  # what it renders is what runs: known now
        assert ctl.views.status()["table"] == "served" and proxy.reloads == 1
        await ctl._take_over()
        ctl.objects["Ingress"][("shop", "new")] = shop_ingress("new")
        proxy.fail_reloads = 1
        await ctl._sync()
        assert ctl.error is not None and ctl.views.status()["table"] == "wanted"
        await ctl._sync()
        assert ctl.error is None and ctl.views.status()["table"] == "served"

    asyncio.run(main())


def test_a_user_the_workers_cannot_run_as_stops_the_render_with_its_reason_until_it_can(tmp_path, monkeypatch):
    """[ingress] user that cannot be used (no such user, a switch the sandbox forbids): no
    configuration is rendered (nothing started or reloaded), the reason is the error; once it
    can (asked again at each try), the workers' user and group are in the configuration and
    the proxy's directory is the group's to pass through (0710, no set-group-ID bit: the
    unit's RestrictSUIDSGID=yes refuses one, as this test does), the access log's socket in
    it writable (0622) by whoever can reach it."""
    import os
    import stat

    from agentd.ingress import controller as ctl_module
    from agentd.ingress.proxy import RunAs

    ctl, _ = controller(tmp_path, user="haproxy")
    answers: list = [ProxyError("[ingress] user haproxy: no such user; create it")]

    def resolve(name: str) -> RunAs | None:
        if isinstance(answers[0], Exception):
            raise answers[0]
        return answers[0]

    monkeypatch.setattr(ctl_module, "resolve_user", resolve)
    fchmod = os.fchmod

    def restricted(fd: int, mode: int) -> None:  # systemd's RestrictSUIDSGID=yes
        if mode & 0o6000:
            raise PermissionError(1, "Operation not permitted")
        fchmod(fd, mode)

    monkeypatch.setattr(os, "fchmod", restricted)

    async def main():
        assert not await ctl._resolve_run_as()
        assert ctl.run_as_error == "[ingress] user haproxy: no such user; create it"
        try:
            await ctl._render()
        except ProxyError as err:
            assert str(err) == ctl.run_as_error
        else:
            raise AssertionError("rendered without a usable user")
        answers[0] = RunAs("haproxy", "haproxy", os.getuid() + 1, os.getgid())
        files, _ = await ctl._render()
        assert ctl.run_as_error is None
        glob = files["haproxy.cfg"].decode().split("defaults")[0]
        assert "    user haproxy\n    group haproxy\n" in glob
        mode = ctl.paths.dir.stat().st_mode
        assert stat.S_IMODE(mode) == 0o710 and ctl.paths.dir.stat().st_gid == os.getgid(), oct(mode)
        assert ctl.access_log.mode == 0o622

    asyncio.run(main())


def test_an_unset_user_is_haproxy_where_it_can_be_used_else_root_with_a_warning(tmp_path, monkeypatch, caplog):
    """[ingress] user not set: a node upgraded without the drop-in's new lines (the switch
    refused by the unit's sandbox) keeps its proxy, its workers root as before, with one
    warning saying what is missing; where the switch works, the workers run as haproxy."""
    import os

    from agentd.ingress import controller as ctl_module
    from agentd.ingress.proxy import RunAs

    why = "HAProxy's workers cannot switch to [ingress] user haproxy (PermissionError: ...): add ..."
    answers: list = [ProxyError(why)]
    asked: list[str] = []

    def resolve(name: str) -> RunAs | None:
        asked.append(name)
        if isinstance(answers[0], Exception):
            raise answers[0]
        return answers[0]

    monkeypatch.setattr(ctl_module, "resolve_user", resolve)

    async def main():
        ctl, _ = controller(tmp_path / "a")
        assert await ctl._resolve_run_as() and await ctl._resolve_run_as()
        assert ctl.run_as is None and ctl.run_as_error is None
        files, _ = await ctl._render()
        assert "    user " not in files["haproxy.cfg"].decode()
        warnings = [r.getMessage() for r in caplog.records if "run as root" in r.getMessage()]
        assert len(warnings) == 1 and why in warnings[0], warnings
        answers[0] = RunAs("haproxy", "haproxy", os.getuid() + 1, os.getgid())
        ctl, _ = controller(tmp_path / "b")
        assert await ctl._resolve_run_as() and ctl.run_as == answers[0]
        files, _ = await ctl._render()
        assert "    user haproxy\n    group haproxy\n" in files["haproxy.cfg"].decode()
        assert asked == ["haproxy"] * 3

    asyncio.run(main())


def test_a_tls_entry_without_hosts_that_covers_nothing_is_said(tmp_path):
    """A tls entry without hosts stands for its Ingress's hosts its certificate covers: one whose
    Secret is missing (a typo), or whose certificate names none of them, covers nothing -- and
    says so in tls_errors (and the log), as an entry with hosts always did."""
    import base64

    from agentd.ingress import certs

    ctl, _ = controller(tmp_path)
    ctl.objects["IngressClass"][("", "agentd")] = CLASS
    for name, secret in (("a", "typo"), ("b", "other")):
        ing = shop_ingress(name)
        ing["spec"]["tls"] = [{"secretName": secret}]
        ctl.objects["Ingress"][("shop", name)] = ing
    pem = certs.self_signed("other", ("other.example",))
    crt, key = pem.split(b"-----END CERTIFICATE-----\n")[0] + b"-----END CERTIFICATE-----\n", \
        pem.split(b"-----END CERTIFICATE-----\n")[1]
    ctl.objects["Secret"][("shop", "other")] = {"type": "kubernetes.io/tls", "data": {
        "tls.crt": base64.b64encode(crt).decode(), "tls.key": base64.b64encode(key).decode()}}

    async def main():
        await ctl._render()
        # Each rule host the default certificate (redirected, as ingress-nginx does).
        assert [(t.host, t.secret, t.serves) for t in ctl.table.tls] == [("a.example", None, False), ("b.example", None, False)]
        assert ctl.tls_errors["shop/typo"].startswith("no such Secret (a tls entry without hosts)")
        assert "names none of its Ingress's rule hosts" in ctl.tls_errors["shop/other"]

    asyncio.run(main())


def test_an_unset_user_whose_directory_cannot_be_given_to_its_group_falls_back_to_root(tmp_path, monkeypatch):
    """[ingress] user not set, the switch possible but the directory not the group's (no
    SupplementaryGroups= in the drop-in: fchown refused): the workers stay root, the proxy runs."""
    import os

    from agentd.ingress import controller as ctl_module
    from agentd.ingress.proxy import RunAs

    monkeypatch.setattr(ctl_module, "resolve_user", lambda name: RunAs("haproxy", "haproxy", os.getuid() + 1, 4242))

    def refused(fd: int, uid: int, gid: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "fchown", refused)

    async def main():
        ctl, _ = controller(tmp_path)
        assert await ctl._resolve_run_as() and ctl.run_as is None and ctl.run_as_error is None
        assert "SupplementaryGroups=haproxy" in (ctl.run_as_fallback or "")
        assert ctl.paths.dir.stat().st_mode & 0o777 == 0o700
        files, _ = await ctl._render()
        assert "    user " not in files["haproxy.cfg"].decode()
        ctl, _ = controller(tmp_path / "named", user="haproxy")  # named: must be usable
        assert not await ctl._resolve_run_as() and "SupplementaryGroups=haproxy" in (ctl.run_as_error or "")

    asyncio.run(main())


def test_a_default_certificate_that_does_not_load_is_made_again(tmp_path):
    """default.pem is written once; an empty or torn one (a power loss before it reached the
    disk) would make HAProxy refuse every start and reload: every Ingress down for good."""
    from agentd.ingress import certs

    ctl, _ = controller(tmp_path)
    ctl._prepare_dir(None)
    good = ctl.paths.default_cert.read_bytes()
    assert certs.refused(good, tmp_path) is None
    ctl._prepare_dir(None)
    assert ctl.paths.default_cert.read_bytes() == good  # one that loads is kept
    for bad in (b"", b"garbage\n", good[: len(good) // 2]):
        ctl.paths.default_cert.write_bytes(bad)
        ctl._prepare_dir(None)
        pem = ctl.paths.default_cert.read_bytes()
        assert pem != bad and certs.refused(pem, tmp_path) is None, bad
        assert ctl.paths.default_cert.stat().st_mode & 0o777 == 0o600


def test_a_written_file_is_synced_and_never_takes_a_leftover_temporary_files_mode(tmp_path, monkeypatch):
    import os

    from agentd.ingress import controller as ctl_module

    key = tmp_path / "certs" / "shop.tls.pem"
    key.parent.mkdir()
    leftover = key.with_name(key.name + ".tmp")  # left by a crash, readable by all
    leftover.write_bytes(b"old")
    os.chmod(leftover, 0o644)
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    ctl_module._write(key, b"private key")
    assert key.read_bytes() == b"private key" and not leftover.exists()
    assert key.stat().st_mode & 0o777 == 0o600  # not readable by others
    assert synced == [str(leftover), str(key.parent)]  # the file before its rename, the rename after


def test_a_configmap_of_digits_int_refuses_keeps_the_settings_in_use(tmp_path, caplog):
    """Stored unchecked under another name than the CLI's [ingress] configmap, "²" or 5000 digits
    reached int(): its ValueError went up through the sync and the controller crash-looped."""
    ctl, _ = controller(tmp_path)
    ctl.objects["ConfigMap"][CONFIGMAP] = {"data": {"keep-alive": "30"}}
    kept = ctl._parse_settings()
    ctl.settings = kept
    assert kept.keep_alive == 30 and ctl.settings_error is None
    for data in ({"keep-alive": "\u00b2"}, {"proxy-read-timeout": "9" * 5000}, {"proxy-body-size": "9" * 5000 + "m"}):
        ctl.objects["ConfigMap"][CONFIGMAP] = {"data": data}
        assert ctl._parse_settings() is kept, data
        assert ctl.settings_error is not None and "keeping" not in ctl.settings_error
        assert ctl.settings_error.startswith(f"ConfigMap kube-system/agentd-ingress: data[{next(iter(data))}]: Invalid value")
    assert "keeping the settings in use" in caplog.text


def test_a_value_error_the_checks_missed_keeps_the_settings_in_use(tmp_path, monkeypatch):
    """A safety net: whatever ValueError parsing raises is the ConfigMap's error, not a crash loop."""
    from agentd.ingress import controller as controller_module

    ctl, _ = controller(tmp_path)

    def parse(data, where):
        raise ValueError("invalid literal for int() with base 10: '\u00b2'")

    monkeypatch.setattr(controller_module.settings, "parse", parse)
    assert ctl._parse_settings() is ctl.settings
    assert ctl.settings_error == "ConfigMap kube-system/agentd-ingress: data: invalid literal for int() with base 10: '\u00b2'"


def test_a_certificate_that_does_not_cover_its_host_is_not_served_for_it_and_is_said(tmp_path):
    """A tls entry naming shop.example with a certificate for other.example only: not written
    to the crt-list for shop.example (a client would refuse it), said in tls_errors; a newer
    Ingress's Secret whose certificate covers shop.example serves it (ingress-nginx checks
    VerifyHostname alike, then serves the default certificate)."""
    import base64

    from agentd.ingress import certs

    def secret(*names: str) -> dict:
        pem = certs.self_signed(names[0], names)
        crt, key = pem.split(b"-----BEGIN PRIVATE KEY-----")
        return {"type": "kubernetes.io/tls", "data": {"tls.crt": base64.b64encode(crt).decode(),
                                                      "tls.key": base64.b64encode(b"-----BEGIN PRIVATE KEY-----" + key).decode()}}

    ctl, _ = controller(tmp_path)
    ctl.objects["IngressClass"][("", "agentd")] = CLASS
    a = shop_ingress("shop")
    a["spec"]["tls"] = [{"hosts": ["shop.example"], "secretName": "s"}]
    ctl.objects["Ingress"][("shop", "a")] = {**a, "metadata": {**a["metadata"], "name": "a"}}
    ctl.objects["Secret"][("shop", "s")] = secret("other.example")
    ctl.objects["Secret"][("shop", "good")] = secret("shop.example")

    async def main():
        files, _ = await ctl._render()
        assert files["crt-list"] == b""
        assert ctl.tls_errors == {"shop/s": "its certificate does not cover shop.example (no subjectAltName for it): "
                                            "shop.example served with the default certificate"}
        b = shop_ingress("shop")
        b["metadata"] = {**b["metadata"], "name": "b", "creationTimestamp": "2024-02-01T00:00:00Z"}
        b["spec"]["tls"] = [{"hosts": ["shop.example"], "secretName": "good"}]
        ctl.objects["Ingress"][("shop", "b")] = b
        files, _ = await ctl._render()
        assert files["crt-list"].decode() == f"{ctl.paths.certs}/shop.good.pem shop.example\n"
        assert ctl.tls_errors == {"shop/s": "its certificate does not cover shop.example (no subjectAltName for it): "
                                            "shop.example served with shop/good's certificate"}
        assert "shop/a: tls for shop.example: its Secret cannot serve it; shop/b's does" in ctl.table.conflicts

    asyncio.run(main())


def test_a_wildcard_entrys_secret_not_issued_yet_is_said_and_its_rule_host_redirected(tmp_path):
    """Review s57/r12 #1: rule shop.example, tls hosts ["*.example"], the Secret not there yet
    (cert-manager's usual state before issuance): shop.example was no TLS host (no redirect)
    and tls_errors was empty.  Now: redirected, the default certificate, the Secret named."""
    import base64

    from agentd.ingress import certs

    ctl, _ = controller(tmp_path)
    ctl.objects["IngressClass"][("", "agentd")] = CLASS
    a = shop_ingress("shop")
    a["spec"]["tls"] = [{"hosts": ["*.example"], "secretName": "wild"}]
    ctl.objects["Ingress"][("shop", "shop")] = a

    async def main():
        files, _ = await ctl._render()
        assert files["tls-hosts.lst"] == b"shop.example\n" and files["crt-list"] == b""
        assert ctl.table.redirects("shop.example", "/")
        assert ctl.tls_errors == {"shop/wild": "no such Secret: shop.example served with the default certificate"}
        assert ctl.table.conflicts == []
        # Issued for other names: said as a certificate that does not cover the host.
        pem = certs.self_signed("other", ("*.other.example",))
        crt, key = pem.split(b"-----BEGIN PRIVATE KEY-----")
        ctl.objects["Secret"][("shop", "wild")] = {"type": "kubernetes.io/tls", "data": {
            "tls.crt": base64.b64encode(crt).decode(), "tls.key": base64.b64encode(b"-----BEGIN PRIVATE KEY-----" + key).decode()}}
        files, _ = await ctl._render()
        assert files["tls-hosts.lst"] == b"shop.example\n" and files["crt-list"] == b""
        assert ctl.tls_errors == {"shop/wild": "its certificate does not cover shop.example (no subjectAltName for it): "
                                               "shop.example served with the default certificate"}

    asyncio.run(main())
