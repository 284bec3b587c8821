"""`weightbridge.mesh.monarch_api`: a torchmonarch without the private API the agents use fails
once, clearly, at `TransferGroup.spawn`, not with an AttributeError inside a peer call."""

import pytest
from monarch._src.actor import actor_mesh

from weightbridge.mesh import monarch_api
from weightbridge.mesh.group import TransferGroup


@pytest.fixture
def fresh_check():
    monarch_api.check.cache_clear()
    yield
    monarch_api.check.cache_clear()


def test_the_installed_monarch_has_every_private_name_used(fresh_check):
    monarch_api.check()  # (the supported release: no error)


def test_a_monarch_without_the_private_port_call_is_refused_at_spawn(fresh_check, monkeypatch):
    monkeypatch.delattr(actor_mesh.Port, "_resolve_and_send_blocking")
    with pytest.raises(ImportError) as e:
        TransferGroup.spawn(object(), object(), engine_size=1)  # refused before any use
    message = str(e.value)
    assert f"torchmonarch {monarch_api.SUPPORTED}.x" in message
    assert "Port._resolve_and_send_blocking" in message
    assert monarch_api.installed_version() in message
    assert "pip install" in message
