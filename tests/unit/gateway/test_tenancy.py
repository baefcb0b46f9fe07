"""Who a request is: the tenants file's keys (401 unknown, 403 disabled), the single
API key as one tenant, and the file re-read on change or SIGHUP without a restart."""

import os
import signal
from contextlib import AsyncExitStack

import pytest
from aiohttp.test_utils import TestClient, TestServer

from libs.common import tenants as tenants_file
from libs.common.tenants import Tenant, Tenants
from libs.protocol.hashing import ROOT
from services.gateway.app import Gateway
from services.gateway.errors import AuthenticationError, PermissionDeniedError
from services.gateway.routes import init_app
from services.gateway.tenancy import TenantDirectory
from tests.integration.conftest import wait_until_async
from tests.unit.gateway.conftest import gateway_settings


def write_tenants(path, **tenants: Tenant) -> None:
    tenants_file.write(path, Tenants(tenants, b"secret"))


@pytest.fixture
def keys():
    return {name: tenants_file.new_key() for name in ("alice", "bob", "carol")}


@pytest.fixture
def tenants_path(tmp_path, keys):
    path = tmp_path / "tenants.toml"
    write_tenants(path, alice=Tenant("alice", (tenants_file.hash_key(keys["alice"]),)),
                  bob=Tenant("bob", (tenants_file.hash_key(keys["bob"]),), disabled=True))  # fmt: skip
    return path


def test_a_key_is_its_tenant_unknown_is_401_disabled_is_403(tenants_path, keys):
    directory = TenantDirectory(str(tenants_path))
    assert directory.authenticate(f"Bearer {keys['alice']}").name == "alice"
    for header in (None, "Bearer", f"Basic {keys['alice']}", "Bearer kvs-nope"):
        with pytest.raises(AuthenticationError):
            directory.authenticate(header)
    with pytest.raises(PermissionDeniedError):
        directory.authenticate(f"Bearer {keys['bob']}")


def test_without_a_file_one_default_tenant_in_the_default_scope():
    anyone = TenantDirectory()
    tenant = anyone.authenticate(None)
    assert (tenant.name, anyone.hash_root(tenant), anyone.needs_key) == ("default", ROOT, False)
    keyed = TenantDirectory(api_key="sekret")
    assert keyed.authenticate("Bearer sekret").name == "default"
    assert keyed.hash_root(keyed.authenticate("Bearer sekret")) == ROOT  # the cache as it was without tenants
    with pytest.raises(AuthenticationError):
        keyed.authenticate("Bearer wrong")


def test_with_a_file_the_single_key_is_one_more_tenant(tenants_path, keys):
    directory = TenantDirectory(str(tenants_path), api_key="sekret")
    assert directory.authenticate("Bearer sekret").name == "default"
    assert directory.authenticate(f"Bearer {keys['alice']}").name == "alice"


def test_a_reload_takes_a_rotated_key_and_keeps_the_tenants_when_the_file_is_bad(tenants_path, keys):
    directory = TenantDirectory(str(tenants_path))
    held = directory.authenticate(f"Bearer {keys['alice']}")  # a request in flight keeps its tenant
    new = tenants_file.new_key()
    write_tenants(tenants_path, alice=Tenant("alice", (tenants_file.hash_key(new),)))
    assert directory.changed()
    assert directory.reload()
    assert directory.authenticate(f"Bearer {new}").name == "alice"
    with pytest.raises(AuthenticationError):
        directory.authenticate(f"Bearer {keys['alice']}")
    assert held.name == "alice"
    tenants_path.write_text("[tenants.alice\n")  # half-written by hand: not TOML
    assert not directory.reload()
    assert directory.authenticate(f"Bearer {new}").name == "alice"


async def test_the_watch_reloads_on_change_and_on_sighup(tenants_path, keys):
    directory = TenantDirectory(str(tenants_path))
    async with AsyncExitStack() as stack:
        await directory.watch(stack)
        write_tenants(tenants_path, carol=Tenant("carol", (tenants_file.hash_key(keys["carol"]),)))
        await wait_until_async(lambda: directory.reloads == 1, 10, "no reload after the file changed")
        assert directory.authenticate(f"Bearer {keys['carol']}").name == "carol"
        os.kill(os.getpid(), signal.SIGHUP)
        await wait_until_async(lambda: directory.reloads == 2, 10, "no reload after SIGHUP")


@pytest.fixture
async def tenant_client(served_model, tenants_path):
    gateway = Gateway(gateway_settings(tenants_file=str(tenants_path)), model=served_model)
    async with TestClient(TestServer(init_app(gateway, gateway.generations))) as client:
        yield client


async def test_http_401_for_an_unknown_key_403_for_a_disabled_tenant(tenant_client, keys):
    response = await tenant_client.get("/v1/models", headers={"Authorization": "Bearer kvs-nope"})
    body = await response.json()
    assert (response.status, body["error"]["code"], body["error"]["type"]) == (401, "invalid_api_key",
                                                                              "invalid_request_error")  # fmt: skip
    response = await tenant_client.get("/v1/models", headers={"Authorization": f"Bearer {keys['bob']}"})
    body = await response.json()
    assert (response.status, body["error"]["code"]) == (403, "tenant_disabled")
    assert keys["bob"] not in body["error"]["message"]
    assert (await tenant_client.get("/v1/models", headers={"Authorization": f"Bearer {keys['alice']}"})).status == 200
    assert (await tenant_client.get("/health/live")).status == 200
