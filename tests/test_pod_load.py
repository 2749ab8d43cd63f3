"""`PodLoad`, the one type a pod's load travels as: its conversions to and from the
`WorkerStats` proto and the registry hash, and the wire names those keep."""

from __future__ import annotations

from splitserve.common.pod_load import FIELD_NAMES, PodLoad
from splitserve.common.registry_schema import PodRecord
from splitserve.gateway.routing.scoring import Location, PodView
from splitserve.v1 import worker_pb2

LOAD = PodLoad(num_running=3, num_waiting=2, kv_blocks_total=200, kv_blocks_free=150)


def test_load_goes_through_the_proto_unchanged():
    proto_fields = {field.name for field in worker_pb2.WorkerStats.DESCRIPTOR.fields}
    assert set(FIELD_NAMES) <= proto_fields
    stats = worker_pb2.WorkerStats(worker_id="d-0", role="decode", **LOAD.as_fields())
    assert PodLoad.from_proto(stats) == LOAD


def test_derived_figures():
    assert (LOAD.num_queued, LOAD.kv_blocks_used, LOAD.kv_usage) == (5, 50, 0.25)
    assert PodLoad().kv_usage == 1.0  # a pod that reported no blocks has no headroom
    view = PodView("d-0", "h:1", Location(), LOAD, num_dispatched=4)
    assert (view.num_queued, view.kv_usage) == (9, 0.25)


def test_the_registry_hash_keeps_its_field_names():
    """Pods, gateways and autoscalers of two versions share one Redis during an upgrade."""
    record = PodRecord("d-0", "decode", "h:1", 7, load=LOAD, recent_ttft_s=0.5)
    fields = record.to_fields()
    assert set(fields) == {
        "worker_id", "role", "address", "generation", "model", "kv_address", "kv_transport",
        "region", "zone", "node", "block_size", "hash_namespace", "kv_blocks_total",
        "kv_blocks_free", "num_running", "num_waiting", "recent_ttft_s", "recent_itl_s",
        # Added with the parallel layout; older readers skip fields they do not know.
        "tensor_parallel_size", "pipeline_parallel_size",
        # Added with the KV offload tiers (the router credits tiers by these costs).
        "prefill_s_per_token", "host_load_s_per_block", "disk_load_s_per_block",
        # Added with LoRA adapters (comma-separated names; the gateway routes by residency).
        "lora_adapters", "resident_lora_adapters",
        # Added with admission control: the prefill work queued ahead of a new request.
        "num_waiting_prompt_tokens",
    }  # fmt: skip
    assert (fields["worker_id"], fields["num_running"], fields["kv_blocks_free"]) == (
        "d-0",
        "3",
        "150",
    )
    assert PodRecord.from_fields(fields) == record


def test_a_record_without_load_fields_reads_as_no_load():
    old = {b"worker_id": b"p-0", b"role": b"prefill", b"address": b"h:2", b"generation": b"1"}
    record = PodRecord.from_fields(old)
    assert record is not None
    assert (record.pod_id, record.load) == ("p-0", PodLoad())
    assert PodRecord.from_fields({b"role": b"prefill"}) is None  # no pod id: not a record
