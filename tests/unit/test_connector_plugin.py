"""The vllm.general_plugins entry point makes the guide's connector ours."""

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.plugins import load_general_plugins

from vllm_ascend.kv_offload.connector import AscendOffloadingConnector


def test_offloading_connector_name_resolves_to_the_ascend_variant():
    load_general_plugins()
    cls = KVConnectorFactory.get_connector_class_by_name("OffloadingConnector")
    assert cls is AscendOffloadingConnector
    # Still vLLM's connector for everything but the layouts it adds.
    assert issubclass(cls, OffloadingConnector)


def test_registering_twice_is_harmless():
    from vllm_ascend.kv_offload.connector import register

    register()
    register()
    cls = KVConnectorFactory.get_connector_class_by_name("OffloadingConnector")
    assert cls is AscendOffloadingConnector
