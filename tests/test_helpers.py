"""The test helpers that read other programs' files read them right."""
import json
import struct

from helpers import wandb_history


def leveldb_log(records: list[bytes]) -> bytes:
    """`records` as wandb writes them: a 7-byte file header, then one full chunk each (no
    record here crosses a 32 KiB block)."""
    out = b":W&B\x00\x00\x00"
    for r in records:
        out += b"\x00" * 4 + struct.pack("<HB", len(r), 1) + r
    return out


def history_record(step: int) -> bytes:
    from wandb.proto import wandb_internal_pb2 as pb

    rec = pb.Record()
    rec.history.item.add(key="_step", value_json=json.dumps(step))
    rec.history.item.add(key="loss", value_json=json.dumps(0.5 * step))
    return rec.SerializeToString()


def test_wandb_history_leaves_out_a_record_still_being_written(tmp_path):
    run = tmp_path / "wandb" / "offline-run-1"
    run.mkdir(parents=True)
    whole = leveldb_log([history_record(1), history_record(2)])
    (run / "run-1.wandb").write_bytes(whole)
    assert wandb_history(tmp_path) == [{"_step": 1, "loss": 0.5}, {"_step": 2, "loss": 1.0}]
    for cut in (len(whole) - 3, len(whole) - len(history_record(2)) - 2):  # mid-record, mid-header
        (run / "run-1.wandb").write_bytes(whole[:cut])
        assert wandb_history(tmp_path) == [{"_step": 1, "loss": 0.5}]
    (run / "run-1.wandb").write_bytes(whole + b"\x00" * 64)  # space the writer has not filled yet
    assert len(wandb_history(tmp_path)) == 2
