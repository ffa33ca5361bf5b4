import subprocess
import sys
import textwrap
import uuid

import pytest

from kvrelay.kv_transfer import KVConnectorRole, create_connector, factory, register_connector
from kvrelay.kv_transfer.reference.example import ExampleConnector
from tests.kv_transfer.builders import engine_config, kv_spec
from tests.kv_transfer.fake_connector import FakeConnector, fake_transfer_config

ROLES = (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER)


@pytest.fixture(autouse=True)
def private_registry(monkeypatch):
    """Registrations made by a test stay in that test."""
    monkeypatch.setattr(factory, "_registry", dict(factory._registry))


def example_config(tmp_path, name="ExampleConnector"):
    return engine_config({"kv_connector": name,
                          "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}})


def write_module(tmp_path, monkeypatch, body: str) -> str:
    name = f"kvrelay_test_ext_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("name", ["ExampleConnector", "SharedStorageConnector"])
def test_builtin_and_alias_create_the_example_connector(tmp_path, name, role):
    connector = create_connector(example_config(tmp_path, name), role, kv_spec())
    assert type(connector) is ExampleConnector and connector.role is role
    assert connector.kv_spec == kv_spec()


def test_external_module_path_loads_the_named_class(tmp_path, monkeypatch):
    module = write_module(tmp_path, monkeypatch, """
        from tests.kv_transfer.fake_connector import FakeConnector

        class MyConnector(FakeConnector):
            pass
    """)
    config = engine_config({"kv_connector": "MyConnector", "kv_connector_module_path": module})
    connector = create_connector(config, KVConnectorRole.SCHEDULER, kv_spec())
    assert type(connector).__name__ == "MyConnector" and type(connector).__module__ == module


def test_external_class_that_is_not_a_connector_is_a_type_error(tmp_path, monkeypatch):
    module = write_module(tmp_path, monkeypatch, "class NotAConnector:\n    pass\n")
    config = engine_config({"kv_connector": "NotAConnector", "kv_connector_module_path": module})
    with pytest.raises(TypeError, match="must be a subclass of kvrelay.kv_transfer.KVConnectorBase"):
        create_connector(config, KVConnectorRole.SCHEDULER, kv_spec())


def test_external_module_without_the_class_names_it(tmp_path, monkeypatch):
    module = write_module(tmp_path, monkeypatch, "x = 1\n")
    config = engine_config({"kv_connector": "Missing", "kv_connector_module_path": module})
    with pytest.raises(ValueError, match="has no attribute 'Missing'"):
        create_connector(config, KVConnectorRole.SCHEDULER, kv_spec())


def test_unknown_name_lists_the_known_connectors():
    with pytest.raises(ValueError, match="unknown kv_connector 'Nope'.*ExampleConnector.*MultiConnector"):
        create_connector(engine_config({"kv_connector": "Nope"}), KVConnectorRole.SCHEDULER, kv_spec())


def test_no_configured_connector_is_an_error():
    with pytest.raises(ValueError, match="no KV connector is configured"):
        create_connector(engine_config(None), KVConnectorRole.SCHEDULER, kv_spec())


def test_creating_one_connector_does_not_import_another_connectors_transport(tmp_path, monkeypatch):
    heavy = write_module(tmp_path, monkeypatch, "raise RuntimeError('heavy transport imported')\n")
    register_connector("HeavyConnector", heavy, "HeavyConnector")
    create_connector(example_config(tmp_path / "kv"), KVConnectorRole.WORKER, kv_spec())
    assert heavy not in sys.modules
    with pytest.raises(RuntimeError, match="heavy transport imported"):
        create_connector(engine_config({"kv_connector": "HeavyConnector"}), KVConnectorRole.WORKER, kv_spec())


def test_registering_a_name_twice_with_another_target_is_an_error():
    register_connector("Twice", "a.module", "Cls")
    register_connector("Twice", "a.module", "Cls")  # the same target again is fine
    with pytest.raises(ValueError, match="already registered"):
        register_connector("Twice", "other.module", "Cls")


def test_fake_connector_is_selectable_by_module_path_and_by_name():
    by_path = create_connector(engine_config(fake_transfer_config()), KVConnectorRole.SCHEDULER, kv_spec())
    by_name = create_connector(engine_config({"kv_connector": "FakeConnector"}),
                               KVConnectorRole.SCHEDULER, kv_spec())
    assert type(by_path) is FakeConnector and type(by_name) is FakeConnector


def test_both_roles_built_from_one_config_share_its_engine_id(tmp_path):
    config = example_config(tmp_path)
    scheduler_side, worker_side = (create_connector(config, role, kv_spec()) for role in ROLES)
    assert scheduler_side.transfer_config.engine_id == worker_side.transfer_config.engine_id
    assert scheduler_side.transfer_config is config.kv_transfer


def test_a_raw_dict_config_is_normalized_for_the_connector(tmp_path):
    from kvrelay.config import EngineConfig
    config = EngineConfig(kv_transfer={"kv_connector": "ExampleConnector",
                                       "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}})
    connector = create_connector(config, KVConnectorRole.SCHEDULER, kv_spec())
    assert connector.config.kv_transfer is connector.transfer_config


def test_scheduler_side_connectors_never_import_torch(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        from kvrelay.config import EngineConfig
        from kvrelay.kv_transfer import KVCacheSpec, KVConnectorRole, KVTransferConfig, create_connector
        spec = KVCacheSpec(block_size=4, num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32")
        example = {{"kv_connector": "ExampleConnector",
                    "kv_connector_extra_config": {{"shared_storage_path": {str(tmp_path)!r}}}}}
        multi = {{"kv_connector": "MultiConnector", "kv_connector_extra_config": {{"connectors": [example]}}}}
        for cfg in (example, multi):
            config = EngineConfig(kv_transfer=KVTransferConfig.from_any(cfg))
            create_connector(config, KVConnectorRole.SCHEDULER, spec).build_connector_meta
        assert "torch" not in sys.modules, "torch was imported"
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
